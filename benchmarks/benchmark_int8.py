"""runtime.precision=int8 against fp32 through translate.py, under each instruction-set setting.

    python benchmarks/benchmark_int8.py checkpoint=PATH                      # every setting, test_2016_flickr, beam 5
    python benchmarks/benchmark_int8.py checkpoint=PATH isas=[native,avx2] rounds=3 split=val

For each setting (native: the CPU as it is; the others: ISA_LIMITS in transformer/devices.py,
as on other CPUs), translate.py runs as a whole process with fp32 and with int8, in turns,
`rounds` times; the table gives the median wall time of each, their ratio (int8 / fp32, measured
in the same run), sacreBLEU of each against the split's references, and what int8's start-up
check chose (the line translate.py logs). Prints the CPU's features first.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import sacrebleu

from transformer.cli import parse_args, setup_logging
from transformer.data import corpus_file, read_lines, write_lines
from transformer.devices import ISA_LIMITS, describe_cpu
from transformer.errors import exit_on_user_error

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Int8BenchConfig:
    checkpoint: str = "???"
    isas: list[str] = field(default_factory=lambda: ["native", *ISA_LIMITS])
    split: str = "test_2016_flickr"
    data_dir: str = str(ROOT / "data" / "multi30k")
    src_lang: str = "de"
    tgt_lang: str = "en"
    beam_size: int = 5
    rounds: int = 2

    def __post_init__(self) -> None:
        unknown = [i for i in self.isas if i != "native" and i not in ISA_LIMITS]
        if unknown:
            raise ValueError(f"isas: {unknown} unknown; choose from native, {', '.join(ISA_LIMITS)}")
        if self.rounds < 1:
            raise ValueError(f"rounds={self.rounds} must be >= 1")


def translate(cfg: Int8BenchConfig, isa: str, precision: str, source: Path, output: Path) -> tuple[float, str]:
    """(seconds, int8's start-up line or "") of one translate.py process."""
    env = {**os.environ, **ISA_LIMITS.get(isa, {})}
    command = [sys.executable, str(ROOT / "translate.py"), f"checkpoint={cfg.checkpoint}", f"input={source}",
               f"output={output}", "device=cpu", f"decode.beam_size={cfg.beam_size}", f"runtime.precision={precision}"]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"translate.py ({isa}, {precision}) failed: {done.stderr.strip()[-2000:]}")
    plan = next((line for line in done.stderr.splitlines() if "runtime.precision=int8" in line), "")
    return seconds, plan


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, Int8BenchConfig, __doc__)
        data = Path(cfg.data_dir)
        references = read_lines(corpus_file(data, cfg.split, cfg.tgt_lang))
        print(f"{describe_cpu()}; {len(references)} lines of {cfg.split}, beam {cfg.beam_size}, {cfg.rounds} rounds in turns")  # fmt: skip
        print("| setting | fp32 s | int8 s | int8 / fp32 | BLEU fp32 | BLEU int8 | int8's start-up check |")
        print("|---|---:|---:|---:|---:|---:|---|")
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "source.txt"
            write_lines(source, read_lines(corpus_file(data, cfg.split, cfg.src_lang)))
            for isa in cfg.isas:
                times, bleu, plan = {"fp32": [], "int8": []}, {}, ""
                for _ in range(cfg.rounds):
                    for precision in ("fp32", "int8"):
                        output = Path(tmp) / f"{isa}.{precision}.txt"
                        seconds, line = translate(cfg, isa, precision, source, output)
                        times[precision].append(seconds)
                        plan = line or plan
                        hypotheses = output.read_text(encoding="utf-8").splitlines()
                        bleu[precision] = sacrebleu.corpus_bleu(hypotheses, [references]).score
                fp32, int8 = statistics.median(times["fp32"]), statistics.median(times["int8"])
                plan = plan.split("runtime.precision=int8: ", 1)[-1]
                print(f"| {isa} | {fp32:.1f} | {int8:.1f} | {int8 / fp32:.2f} | {bleu['fp32']:.2f} | {bleu['int8']:.2f} | {plan} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
