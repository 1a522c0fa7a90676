"""The compiled decoding step (runtime.compiled_step, transformer/fast/compiled.py) against the eager
step, on a checkpoint and one test split, in one run:

    python benchmarks/benchmark_compiled.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt
    python benchmarks/benchmark_compiled.py checkpoint=PATH isa=avx2 rounds=5

1. First use: the seconds compiling each program costs (greedy's and beam search's), in a fresh
   cache directory, and loading a kept one.
2. Decoding alone, in this process: `single` sentences translated one at a time and `sentences`
   sentences in one call, greedy and beam `beam_size`, eager (runtime.compiled_step=false) and
   compiled, timed in turns `rounds` times; medians, their ratio, and whether the outputs are the same.
3. Whole process, one sentence, beam `beam_size`: `python -c "import torch"`, translate.py eager
   and translate.py with the kept program, `rounds` times in turns; medians.

isa=avx2 (or another key of transformer/devices.py's ISA_LIMITS) runs it all under that limit,
which the kept programs' keys name, so it compiles its own. Prints tables; JSON to output= if given.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from unittest import mock

import torch

from common import hardware
from transformer.cli import parse_args
from transformer.data import DataConfig, load_split
from transformer.decoding import DecodeConfig
from transformer.devices import describe_cpu, limit_isa
from transformer.errors import exit_on_user_error
from transformer.fast.compiled import load_program
from transformer.files import atomic_write_text, check_output
from transformer.runtime import RuntimeConfig
from transformer.translator import Translator

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class CompiledBenchConfig:
    checkpoint: str = "???"
    split: str = "test_2016_flickr"
    data_dir: str = "data/multi30k"
    single: int = 50  # sentences translated one at a time
    sentences: int = 1000  # sentences translated in one call
    beam_size: int = 5
    rounds: int = 3
    isa: Optional[str] = None
    output: Optional[str] = None

    def __post_init__(self) -> None:
        for key in ("single", "sentences", "beam_size", "rounds"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")


def load(cfg: CompiledBenchConfig, compiled: bool, decode: DecodeConfig) -> Translator:
    return Translator.load(cfg.checkpoint, [], "cpu", decode, RuntimeConfig(compiled_step=compiled))


def first_use(cfg: CompiledBenchConfig, texts: list[str]) -> dict:
    """Seconds to compile each program into a fresh cache directory, and to load the kept one."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, TRANSFORMER_CACHE_DIR=tmp):
        for strategy in ("greedy", "beam"):
            translator = load(cfg, True, DecodeConfig(strategy=strategy, beam_size=cfg.beam_size))
            start = time.perf_counter()
            translator.translate(texts[:1])
            out[f"compile {strategy}"] = time.perf_counter() - start
        program = next(Path(tmp, "compiled").glob("step-*.pt2"))
        start = time.perf_counter()
        load_program(program)
        out["load"] = time.perf_counter() - start
    return out


def decoding(cfg: CompiledBenchConfig, texts: list[str]) -> list[dict]:
    rows = []
    for strategy in ("greedy", "beam"):
        dc = DecodeConfig(strategy=strategy, beam_size=cfg.beam_size)
        translators = {"eager": load(cfg, False, dc), "compiled": load(cfg, True, dc)}
        work = {"one at a time": lambda t: [t.translate([x])[0] for x in texts[: cfg.single]], "one call": lambda t: t.translate(texts[: cfg.sentences])}  # fmt: skip
        for what, run in work.items():
            seconds, outputs = {name: [] for name in translators}, {}
            for t in translators.values():
                t.translate(texts[:2])  # untimed: compiles a missing program, sets up the kernels
            for _ in range(cfg.rounds):
                for name, t in translators.items():
                    start = time.perf_counter()
                    outputs[name] = run(t)
                    seconds[name].append(time.perf_counter() - start)
            eager, compiled = statistics.median(seconds["eager"]), statistics.median(seconds["compiled"])
            n = cfg.single if what == "one at a time" else min(cfg.sentences, len(texts))
            rows.append({"strategy": dc.label, "work": f"{n} sentences {what}", "eager_s": eager, "compiled_s": compiled, "speedup": eager / compiled, "same": outputs["eager"] == outputs["compiled"]})  # fmt: skip
    return rows


def whole_process(cfg: CompiledBenchConfig, line: str) -> dict:
    """Medians of one-sentence processes, in turns: import torch, translate.py eager and compiled."""
    translate = [sys.executable, str(ROOT / "translate.py"), f"checkpoint={cfg.checkpoint}", "device=cpu", f"decode.beam_size={cfg.beam_size}"]  # fmt: skip
    commands = {
        "import torch": [sys.executable, "-c", "import torch"],
        "translate.py eager": [*translate, "runtime.compiled_step=false"],
        "translate.py compiled": [*translate, "runtime.compiled_step=true"],
    }
    subprocess.run(commands["translate.py compiled"], input=line, capture_output=True, text=True, check=True)
    seconds = {name: [] for name in commands}
    for _ in range(cfg.rounds):
        for name, command in commands.items():
            start = time.perf_counter()
            subprocess.run(command, input=line, capture_output=True, text=True, check=True)
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, CompiledBenchConfig, __doc__)
        limit_isa(cfg.isa, __file__, argv)
        if cfg.output:
            check_output(cfg.output, [cfg.checkpoint])
    texts = list(load_split(DataConfig(dir=cfg.data_dir), cfg.split)["src"])
    print(f"{describe_cpu()}; {torch.get_num_threads()} threads; {cfg.checkpoint}; medians of {cfg.rounds} in turns")
    results = {"hardware": hardware(), "checkpoint": cfg.checkpoint, "first_use": first_use(cfg, texts)}
    print(" | ".join(f"{name} {s:.2f} s" for name, s in results["first_use"].items()))
    results["decoding"] = decoding(cfg, texts)
    print("| strategy | work | eager s | compiled s | eager / compiled | same outputs |\n|---|---|---:|---:|---:|---|")
    for r in results["decoding"]:
        print(f"| {r['strategy']} | {r['work']} | {r['eager_s']:.2f} | {r['compiled_s']:.2f} | {r['speedup']:.2f}x | {r['same']} |")  # fmt: skip
    results["whole_process"] = whole_process(cfg, texts[0] + "\n")
    torch_s = results["whole_process"]["import torch"]
    print("| one sentence, whole process | seconds | beyond import torch |\n|---|---:|---:|")
    for name, s in results["whole_process"].items():
        print(f"| {name} | {s:.3f} | {s - torch_s:.3f} |")
    if cfg.output:
        with exit_on_user_error():
            atomic_write_text(cfg.output, json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
