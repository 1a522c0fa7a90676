"""A student against its teacher: sentences/s and sacreBLEU of each, in our decoder and in
CTranslate2, decoding alone and as whole translate.py processes.

    python benchmarks/compare_students.py teacher=outputs/de-en/RUN/checkpoint_best.pt \
        student=outputs/de-en-student/RUN/student/checkpoint_best.pt rounds=3

On the first `sentences` sentences of `split`, greedy and beam 5, it decodes with: the teacher in
our decoder (fp32) and exported to CTranslate2 (float32 and int8 on the same export, no vocabulary
map), and the student in our decoder (fp32, int8, each with and without its shortlist) and in
CTranslate2 (float32; int8 with its vocabulary map). Decoding alone: in-process medians of
`rounds` rounds taken in turns, loading excluded (CTranslate2 in a child process of its own, as
benchmarks/compare_exported.py runs it). Whole process: `translate.py` from start to exit on the
same lines, teacher fp32 and the student fp32 and int8 with the shortlist, medians of `rounds` in
turns. With compiled=true (the default) the teacher and the student fp32 also run with their
compiled decoding steps (runtime.compiled_step=true; the other rows with false), and the student
in int8 with its shortlist (the program calling its int8 decoder layers). isa=avx2 limits
every library to AVX2. Ratios are against the teacher's rows measured in the same run (a compiled
row's against the teacher's compiled row). Prints a table; output= writes JSON. Needs ctranslate2.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from common import hardware
from compare_exported import ChildCTranslate2, in_process, with_shortlist
from transformer.cli import parse_args
from transformer.data import DataConfig, load_split
from transformer.decoding import DecodeConfig
from transformer.decoding.shortlist import shortlist_path
from transformer.devices import limit_isa
from transformer.errors import ConfigError, exit_on_user_error
from transformer.evaluation import score
from transformer.files import atomic_write_text, check_output
from transformer.interop.export import export, require_ctranslate2
from transformer.runtime import RuntimeConfig
from transformer.translator import Translator

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class StudentsConfig:
    teacher: str = "???"
    student: str = "???"
    split: str = "test_2016_flickr"
    data_dir: str = "data/multi30k"
    sentences: int = 1000
    rounds: int = 3
    isa: Optional[str] = None  # e.g. avx2 (transformer/devices.py)
    ct2_batch: int = 64
    whole_process: bool = True  # also time translate.py from start to exit
    compiled: bool = True  # also the teacher and the student fp32 with runtime.compiled_step=true
    output: Optional[str] = None

    def __post_init__(self) -> None:
        for key in ("sentences", "rounds", "ct2_batch"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")


def decoders(cfg: StudentsConfig, tmp: Path) -> tuple[dict, object]:
    """name -> function(sources, decode config) -> (seconds, token ids), and the tokenizer."""
    require_ctranslate2()
    vmap = shortlist_path(Path(cfg.student))
    if not vmap.is_file():
        raise ConfigError(f"the student has no shortlist at {vmap}: distill.py builds it (or scripts/build_shortlist.py)")  # fmt: skip

    def load(path: str, precision: str, compiled: bool = False) -> Translator:
        return Translator.load(path, [], "cpu", runtime=RuntimeConfig(compiled_step=compiled, precision=precision))

    teacher, student, student8 = load(cfg.teacher, "fp32"), load(cfg.student, "fp32"), load(cfg.student, "int8")
    if not teacher.tokenizer.same_as(student.tokenizer):
        raise ConfigError(f"student={cfg.student} has another tokenizer than teacher={cfg.teacher}")
    export(teacher.model, teacher.tokenizer, tmp / "teacher", "float32")
    export(student.model, student.tokenizer, tmp / "student", "float32", shortlist=vmap)
    threads, tok = torch.get_num_threads(), teacher.tokenizer

    def ours(translator):
        return in_process(lambda src, dc: [h[0].tokens for h in translator.translate_ids(src, dc)])

    def theirs(name, model, compute_type):
        return ChildCTranslate2(str(tmp / name), compute_type, threads, tok, model.cfg.max_positions, cfg.ct2_batch)

    runs = {
        "teacher ours fp32": ours(teacher),
        "teacher ctranslate2 float32": theirs("teacher", teacher.model, "float32"),
        "teacher ctranslate2 int8": theirs("teacher", teacher.model, "int8_float32"),
        "student ours fp32": ours(student),
        "student ours int8": ours(student8),
    }
    runs["student ours fp32 shortlist"] = with_shortlist(runs["student ours fp32"])
    runs["student ours int8 shortlist"] = with_shortlist(runs["student ours int8"])
    if cfg.compiled:  # each program compiled on the untimed first call if none is kept
        runs["teacher ours fp32 compiled"] = ours(load(cfg.teacher, "fp32", True))
        runs["student ours fp32 compiled"] = ours(load(cfg.student, "fp32", True))
        runs["student ours fp32 compiled shortlist"] = with_shortlist(runs["student ours fp32 compiled"])
        runs["student ours int8 compiled shortlist"] = with_shortlist(ours(load(cfg.student, "int8", True)))
    runs["student ctranslate2 float32"] = theirs("student", student.model, "float32")
    runs["student ctranslate2 int8 vmap"] = with_shortlist(theirs("student", student.model, "int8_float32"))
    return runs, tok


def decoding_alone(runs: dict, sources, refs, tokenizer, dc: DecodeConfig, rounds: int) -> list[dict]:
    seconds, outputs = {name: [] for name in runs}, {}
    for run in runs.values():
        if not isinstance(run, ChildCTranslate2):
            run(sources[:2], dc)  # untimed: one-time costs
    for _ in range(rounds):
        for name, run in runs.items():
            took, outputs[name] = run(sources, dc)
            seconds[name].append(took)
    rows = []
    for name in runs:
        median = statistics.median(seconds[name])
        bleu = score(tokenizer.decode(outputs[name]), refs).bleu
        rows.append({"strategy": dc.label, "what": "decoding alone", "decoder": name, "seconds": median, "sentences_per_s": len(sources) / median, "bleu": bleu})  # fmt: skip
    return rows


def whole_processes(cfg: StudentsConfig, texts: list[str], dc: DecodeConfig, tmp: Path) -> list[dict]:
    """translate.py from start to exit on the same lines, medians of cfg.rounds in turns."""
    source = tmp / "input.txt"
    source.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    search = ["decode=greedy"] if dc.strategy == "greedy" else ["decode=beam", f"decode.beam_size={dc.beam_size}"]
    eager = "runtime.compiled_step=false"
    commands = {
        "teacher translate.py fp32": [f"checkpoint={cfg.teacher}", eager],
        "student translate.py fp32": [f"checkpoint={cfg.student}", eager],
        "student translate.py int8 shortlist": [
            f"checkpoint={cfg.student}",
            eager,
            "runtime.precision=int8",
            "decode.shortlist=true",
        ],  # fmt: skip
    }
    if cfg.compiled:  # with the programs kept by decoding_alone
        commands["teacher translate.py fp32 compiled"] = [f"checkpoint={cfg.teacher}", "runtime.compiled_step=true"]
        commands["student translate.py fp32 compiled shortlist"] = [f"checkpoint={cfg.student}", "runtime.compiled_step=true", "decode.shortlist=true"]  # fmt: skip
        commands["student translate.py int8 compiled shortlist"] = [f"checkpoint={cfg.student}", "runtime.compiled_step=true", "runtime.precision=int8", "decode.shortlist=true"]  # fmt: skip
    seconds = {name: [] for name in commands}
    for _ in range(cfg.rounds):
        for name, args in commands.items():
            argv = [sys.executable, str(ROOT / "translate.py"), *args, *search, f"input={source}", f"output={tmp / 'out.txt'}"]  # fmt: skip
            started = time.perf_counter()
            subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
            seconds[name].append(time.perf_counter() - started)
    return [{"strategy": dc.label, "what": "whole process", "decoder": name, "seconds": statistics.median(s), "sentences_per_s": len(texts) / statistics.median(s)} for name, s in seconds.items()]  # fmt: skip


def ratios(rows: list[dict]) -> None:
    """Each row's sentences/s over the teacher's (ours fp32, same kind of timing, compiled for a
    compiled row) and over CTranslate2 float32 running the teacher's export."""
    base = {(r["strategy"], r["what"], "compiled" in r["decoder"]): r["sentences_per_s"] for r in rows if r["decoder"].startswith("teacher") and "fp32" in r["decoder"]}  # fmt: skip
    ct2 = {r["strategy"]: r["sentences_per_s"] for r in rows if r["decoder"] == "teacher ctranslate2 float32"}
    for r in rows:
        r["vs_teacher_ours"] = r["sentences_per_s"] / base[r["strategy"], r["what"], "compiled" in r["decoder"]]
        r["vs_teacher_ctranslate2"] = r["sentences_per_s"] / ct2[r["strategy"]]


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, StudentsConfig, __doc__)
        limit_isa(cfg.isa, __file__, argv)
        if cfg.output:
            check_output(cfg.output, [cfg.teacher, cfg.student])
        test = load_split(DataConfig(dir=cfg.data_dir), cfg.split)
        texts, refs = list(test["src"])[: cfg.sentences], list(test["tgt"])[: cfg.sentences]
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            runs, tokenizer = decoders(cfg, Path(tmp))
            sources = tokenizer.source.encode(texts)
            beam = DecodeConfig()
            for dc in (beam.greedy(), beam):
                rows += decoding_alone(runs, sources, refs, tokenizer, dc, cfg.rounds)
                if cfg.whole_process:
                    rows += whole_processes(cfg, texts, dc, Path(tmp))
        ratios(rows)
    results = {"hardware": hardware(), "teacher": cfg.teacher, "student": cfg.student, "sentences": len(texts), "isa": cfg.isa, "rows": rows}  # fmt: skip
    print(json.dumps(results["hardware"]))
    print(f"{len(texts)} {cfg.split} sentences, {torch.get_num_threads()} threads, medians of {cfg.rounds} in turns, isa={cfg.isa or 'native'}")  # fmt: skip
    print(f"{'strategy':<9}{'timing':<16}{'decoder':<46}{'BLEU':>7}{'sent/s':>8}{'/teacher':>10}{'/CT2 teacher':>14}")
    for r in rows:
        bleu = f"{r['bleu']:>7.2f}" if "bleu" in r else f"{'':>7}"
        print(f"{r['strategy']:<9}{r['what']:<16}{r['decoder']:<46}{bleu}{r['sentences_per_s']:>8.0f}{r['vs_teacher_ours']:>9.2f}x{r['vs_teacher_ctranslate2']:>13.2f}x")  # fmt: skip
    if cfg.output:
        with exit_on_user_error():
            atomic_write_text(cfg.output, json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
