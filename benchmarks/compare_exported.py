"""How closely the CTranslate2 export and int8 decoding follow our own fp32 decoding of a checkpoint:
share of identical outputs, sacreBLEU of each, and decoding time, on one test split.

    python benchmarks/compare_exported.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt sentences=500

For greedy search and beam search (beam_size), it decodes the first `sentences` sentences of
`split` with: ours in fp32 (the reference for the shares), ours with runtime.precision=int8, and
the checkpoint exported float32 and run by CTranslate2 (compute_type float32, and int8) as its
users run it: in a process of its own (its thread pool would slow torch's, and torch's its),
all sentences in one translate_batch call that batches them itself (ct2_batch sentences a batch,
grouped by length), the longest of our per-sentence length limits for all; with
reference=true also ours under runtime=reference (the model as written, which ours fp32 must
equal), with compiled=true (the default) "ours fp32 compiled", ours fp32 with
runtime.compiled_step=true (transformer/fast/compiled.py; compiled untimed if none is kept; the
others run with runtime.compiled_step=false) and "ours int8 compiled" (the program calling its
int8 decoder layers), and "ours fp32 paged", the continuous-batching
engine of serve.py (every sentence joining at the first step, on the paged cache). isa=avx2 limits every library to AVX2. Beam
search runs at each of length_penalties, passed to both as their length_penalty: our GNMT
penalty ((5 + length) / 6) ** alpha and CTranslate2's length ** alpha rank alike only at 0, so
the shares at the recipe's 0.6 say how far they part. Each decoder runs `rounds` times, the four
taking turns; the seconds are medians of the decoding alone (no loading), and sentences/s is
sentences / seconds; decoders=[NAME, ...] runs only those rows (and ours fp32). With
shortlist=true, each of ours and CTranslate2's also runs with the run's lexical shortlist
(decode.shortlist=true; use_vmap=True on the same list, exported as vmap.txt). With
whole_process=true it also times whole processes from start to exit on the same lines, written
to a file and translated into one, medians of `rounds` in turns: `translate.py` in fp32 and in
int8 with the compiled step (its program kept by the rows above), and a CTranslate2 user's process
on the export (float32 and int8): ctranslate2 and sentencepiece imported (no torch), the lines
cut into pieces, one translate_batch call as above, the pieces decoded and written. Their
"speed vs ours fp32" is against translate.py fp32.
Prints a table and writes JSON to output= if given.
Needs ctranslate2.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from common import CTranslate2InChild, hardware, timed
from transformer.cli import parse_args
from transformer.data import DataConfig, load_split
from transformer.decoding import DecodeConfig
from transformer.decoding.engine import Engine, Sentence
from transformer.decoding.shortlist import shortlist_path
from transformer.devices import limit_isa
from transformer.errors import ConfigError, exit_on_user_error
from transformer.evaluation import score
from transformer.files import atomic_write_text, check_output
from transformer.interop.export import (
    TARGET_MODEL,
    export,
    length_limits,
    require_ctranslate2,
    search_options,
    source_model,
)
from transformer.runtime import RuntimeConfig
from transformer.translator import Translator


@dataclass
class CompareConfig:
    checkpoint: str = "???"
    split: str = "test_2016_flickr"
    data_dir: str = "data/multi30k"
    sentences: int = 500
    beam_size: int = 5
    length_penalties: list[float] = field(default_factory=lambda: [0.0, 0.6])  # beam search at each
    threads: int = 0
    rounds: int = 1
    reference: bool = True  # also decode with runtime=reference (the model as written): ours fp32 must equal it
    isa: Optional[str] = None  # e.g. avx2: every library limited to that instruction set (transformer/devices.py)
    ct2_batch: int = 64  # CTranslate2's max_batch_size (sentences), as a user would set it
    shortlist: bool = False  # also each decoder with the run's shortlist (scripts/build_shortlist.py)
    compiled: bool = True  # also ours fp32 and int8 with the compiled decoding step (runtime.compiled_step=true)
    decoders: Optional[list[str]] = None  # only these rows, by name (ours fp32 always: the shares are against it)
    whole_process: bool = False  # also translate.py and a CTranslate2 user's process, from start to exit
    output: Optional[str] = None

    def __post_init__(self) -> None:
        for key in ("sentences", "beam_size", "rounds", "ct2_batch"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")


def decoders(cfg: CompareConfig, directory: Path) -> tuple[dict, object, int]:
    """name -> function(sources, decode config) -> (seconds, token ids); the tokenizer; max_positions."""
    require_ctranslate2()  # a clear error before any work when it is missing
    fp32, int8 = (Translator.load(cfg.checkpoint, [], "cpu", runtime=RuntimeConfig(compiled_step=False, precision=p)) for p in ("fp32", "int8"))  # fmt: skip
    tokenizer = fp32.tokenizer
    vmap = shortlist_path(Path(cfg.checkpoint))
    if cfg.shortlist and not vmap.is_file():
        raise ConfigError(f"shortlist=true needs {vmap}: build it with python scripts/build_shortlist.py checkpoint={cfg.checkpoint}")  # fmt: skip
    export(fp32.model, tokenizer, directory, "float32", shortlist=vmap if cfg.shortlist else None)
    threads = torch.get_num_threads()
    limit = fp32.model.cfg.max_positions

    def ours(translator):
        return in_process(lambda src, dc: [h[0].tokens for h in translator.translate_ids(src, dc)])

    def theirs(compute_type):
        return ChildCTranslate2(str(directory), compute_type, threads, tokenizer, limit, cfg.ct2_batch)

    def engine(translator):
        continuous = Engine(translator.model, tokenizer, translator.decode, "cpu", 256 << 20, precision=translator.precision)  # fmt: skip

        def run(src, dc):
            settings = dataclasses.replace(dc, n_best=1)
            out = [None] * len(src)
            for i, ids in enumerate(src):
                continuous.add(Sentence(ids + [tokenizer.eos_id], settings, lambda n_best, i=i: out.__setitem__(i, n_best[0].tokens)))  # fmt: skip
            while continuous.busy:
                continuous.step(dc.max_tokens)
            return out

        return in_process(run)

    runs = {"ours fp32": ours(fp32)}
    if cfg.reference:
        reference = Translator.load(cfg.checkpoint, [], "cpu", DecodeConfig(), RuntimeConfig(fast=False))
        runs["ours fp32 reference"] = ours(reference)
    if cfg.compiled:  # compiled on its untimed first call if none is kept (compare: warming up)
        runs["ours fp32 compiled"] = ours(Translator.load(cfg.checkpoint, [], "cpu", runtime=RuntimeConfig(compiled_step=True)))  # fmt: skip
    runs |= {"ours fp32 paged": engine(fp32), "ours int8": ours(int8)}
    if cfg.compiled:  # int8 with the fp32 decoder layers the compiled step takes (the same program as fp32's)
        runs["ours int8 compiled"] = ours(Translator.load(cfg.checkpoint, [], "cpu", runtime=RuntimeConfig(compiled_step=True, precision="int8")))  # fmt: skip
    runs |= {"ctranslate2 float32": theirs("float32"), "ctranslate2 int8": theirs("int8_float32")}
    if cfg.shortlist:  # the run's shortlist: ours with decode.shortlist, CTranslate2 with use_vmap
        runs |= {f"{name} shortlist": with_shortlist(runs[name]) for name in ("ours fp32", "ours fp32 compiled", "ours int8", "ours int8 compiled", "ctranslate2 float32", "ctranslate2 int8") if name in runs}  # fmt: skip
    return chosen(runs, cfg.decoders), tokenizer, limit


def chosen(runs: dict, names: list[str] | None) -> dict:
    """The decoders named (all when None), and ours fp32, which the shares are measured against."""
    if names is None:
        return runs
    unknown = [name for name in names if name not in runs]
    if unknown:
        raise ConfigError(f"decoders: no decoder named {', '.join(map(repr, unknown))}; with these settings they are {', '.join(runs)}")  # fmt: skip
    return {name: run for name, run in runs.items() if name == "ours fp32" or name in names}


def with_shortlist(run):
    """The decoder `run` with decode.shortlist=true (CTranslate2: use_vmap=True)."""
    if isinstance(run, ChildCTranslate2):
        return dataclasses.replace(run, shortlist=True)
    return lambda src, dc: run(src, dataclasses.replace(dc, shortlist=True))


def in_process(decode):
    """A decoder of ours, timed in this process: function(sources, dc) -> (seconds, token ids)."""
    return lambda src, dc: timed(lambda: decode(src, dc), torch.device("cpu"))


@dataclass
class ChildCTranslate2:
    """CTranslate2 decoding token-id sentences in a child process: (seconds, output token ids)."""

    directory: str
    compute_type: str
    threads: int
    tokenizer: object
    max_positions: int
    batch: int
    shortlist: bool = False  # use_vmap=True

    def __call__(self, sources: list[list[int]], dc: DecodeConfig) -> tuple[float, list[list[int]]]:
        limit = max(length_limits(sources, dc, self.max_positions))
        tok = self.tokenizer
        options = search_options(dataclasses.replace(dc, shortlist=self.shortlist), tok.id_to_piece(tok.pad_id))
        options |= dict(max_decoding_length=limit - 1, max_batch_size=self.batch, batch_type="examples")
        pieces = [[tok.source.id_to_piece(t) for t in s] for s in sources]
        seconds, hypotheses = CTranslate2InChild(self.directory, self.compute_type, self.threads, pieces, options)()
        return seconds, [[tok.piece_to_id(p) for p in h] for h in hypotheses]


def compare(runs: dict, sources, refs, tokenizer, dc: DecodeConfig, rounds: int) -> list[dict]:
    """One row per decoder for the decode settings dc: median seconds of `rounds` runs taken in
    turns, sacreBLEU, and the share of outputs identical to ours fp32."""
    seconds, outputs, rows = {name: [] for name in runs}, {}, []
    for run in runs.values():
        if not isinstance(run, ChildCTranslate2):  # which runs once untimed itself
            run(sources[:2], dc)  # untimed: one-time costs (allocations, kernel setup)
    for _ in range(rounds):
        for name, run in runs.items():
            took, outputs[name] = run(sources, dc)
            seconds[name].append(took)
    lp = dc.length_penalty if dc.strategy == "beam" else 0.0
    for name in runs:
        same = sum(a == b for a, b in zip(outputs[name], outputs["ours fp32"])) / len(sources)
        bleu = score(tokenizer.decode(outputs[name]), refs).bleu
        median = statistics.median(seconds[name])
        rows.append({"strategy": dc.label, "length_penalty": lp, "decoder": name, "seconds": median, "sentences_per_s": len(sources) / median, "bleu": bleu, "same_as_ours_fp32": same})  # fmt: skip
    return rows


ROOT = Path(__file__).resolve().parents[1]

# A CTranslate2 user's whole process on the export: ctranslate2 and sentencepiece (no torch), the
# input lines as pieces, one translate_batch, the best hypotheses decoded into the output file.
CT2_PROCESS = """
import json, sys, ctranslate2, sentencepiece as spm
directory, compute_type, threads, source_model, target_model, source, output, options = sys.argv[1:]
src, tgt = spm.SentencePieceProcessor(model_file=source_model), spm.SentencePieceProcessor(model_file=target_model)
with open(source, encoding="utf-8") as f:
    pieces = src.encode(f.read().splitlines(), out_type=str)
translator = ctranslate2.Translator(directory, device="cpu", compute_type=compute_type, intra_threads=int(threads))
results = translator.translate_batch(pieces, **json.loads(options))
with open(output, "w", encoding="utf-8") as f:
    f.write("".join(tgt.decode(r.hypotheses[0]) + "\\n" for r in results))
"""


def whole_processes(cfg: CompareConfig, texts, refs, sources, tokenizer, dc: DecodeConfig, directory: Path, max_positions: int) -> list[dict]:  # fmt: skip
    """translate.py (fp32; int8 with the compiled step) and CT2_PROCESS (float32, int8) from start
    to exit on `texts` (`sources` as token ids), medians of cfg.rounds in turns: a row each, as
    compare's; CTranslate2 is given our longest length limit, as ChildCTranslate2 is."""
    source, output = directory / "input.txt", directory / "output.txt"
    source.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    search = ["decode=greedy"] if dc.strategy == "greedy" else ["decode=beam", f"decode.beam_size={dc.beam_size}", f"decode.length_penalty={dc.length_penalty}"]  # fmt: skip
    ours = [sys.executable, str(ROOT / "translate.py"), f"checkpoint={cfg.checkpoint}", *search, f"input={source}", f"output={output}"]  # fmt: skip
    options = search_options(dc, tokenizer.id_to_piece(tokenizer.pad_id))
    limit = max(length_limits(sources, dc, max_positions))
    options |= dict(max_decoding_length=limit - 1, max_batch_size=cfg.ct2_batch, batch_type="examples")
    models = [directory / "ct2" / source_model(tokenizer), directory / "ct2" / TARGET_MODEL]
    threads = str(cfg.threads or torch.get_num_threads())

    def theirs(compute_type: str) -> list[str]:
        return [sys.executable, "-c", CT2_PROCESS, str(directory / "ct2"), compute_type, threads, *map(str, models), str(source), str(output), json.dumps(options)]  # fmt: skip

    commands = {
        "process: translate.py fp32": [*ours, "runtime.compiled_step=false"],
        "process: translate.py int8 compiled": [*ours, "runtime.compiled_step=true", "runtime.precision=int8"],
        "process: ctranslate2 float32": theirs("float32"),
        "process: ctranslate2 int8": theirs("int8"),
    }
    seconds, outputs, rows = {name: [] for name in commands}, {}, []
    for _ in range(cfg.rounds):
        for name, argv in commands.items():
            started = time.perf_counter()
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
            seconds[name].append(time.perf_counter() - started)
            if done.returncode != 0:
                raise RuntimeError(f"{name} failed: {done.stderr.strip()[-2000:]}")
            outputs[name] = output.read_text(encoding="utf-8").splitlines()
    lp = dc.length_penalty if dc.strategy == "beam" else 0.0
    for name in commands:
        same = sum(a == b for a, b in zip(outputs[name], outputs["process: translate.py fp32"])) / len(texts)
        median = statistics.median(seconds[name])
        rows.append({"strategy": dc.label, "length_penalty": lp, "decoder": name, "seconds": median, "sentences_per_s": len(texts) / median, "bleu": score(outputs[name], refs).bleu, "same_as_ours_fp32": same})  # fmt: skip
    return rows


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, CompareConfig, __doc__)
        limit_isa(cfg.isa, __file__, argv)
        if cfg.output:
            check_output(cfg.output, [cfg.checkpoint])
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        test = load_split(DataConfig(dir=cfg.data_dir), cfg.split)
        with tempfile.TemporaryDirectory() as tmp:
            runs, tokenizer, max_positions = decoders(cfg, Path(tmp) / "ct2")
            texts, refs = list(test["src"])[: cfg.sentences], list(test["tgt"])[: cfg.sentences]
            sources = tokenizer.source.encode(texts)
            results = {"hardware": hardware(), "checkpoint": cfg.checkpoint, "sentences": len(sources), "rows": []}
            beam = DecodeConfig(beam_size=cfg.beam_size)
            settings = [beam.greedy()] + [dataclasses.replace(beam, length_penalty=lp) for lp in cfg.length_penalties]
            for dc in settings:
                results["rows"] += compare(runs, sources, refs, tokenizer, dc, cfg.rounds)
                if cfg.whole_process:
                    results["rows"] += whole_processes(cfg, texts, refs, sources, tokenizer, dc, Path(tmp), max_positions)  # fmt: skip
    print(json.dumps(results["hardware"]))
    print(
        f"{cfg.checkpoint}: {len(sources)} {cfg.split} sentences, {torch.get_num_threads()} threads, medians of {cfg.rounds}"
    )
    print(
        f"{'strategy':<9}{'lp':>5} {'decoder':<38}{'BLEU':>7}{'same':>8}{'seconds':>9}{'sent/s':>8}{'speed vs ours fp32':>20}"
    )
    process = lambda r: r["decoder"].startswith("process: ")  # noqa: E731
    reference = {
        (r["strategy"], r["length_penalty"], process(r)): r["seconds"]
        for r in results["rows"]
        if r["decoder"] in ("ours fp32", "process: translate.py fp32")
    }
    for r in results["rows"]:
        r["speed_vs_ours_fp32"] = reference[r["strategy"], r["length_penalty"], process(r)] / r["seconds"]
        print(f"{r['strategy']:<9}{r['length_penalty']:>5.1f} {r['decoder']:<38}{r['bleu']:>7.2f}{r['same_as_ours_fp32']:>8.1%}{r['seconds']:>9.2f}{r['sentences_per_s']:>8.0f}{r['speed_vs_ours_fp32']:>19.2f}x")  # fmt: skip
    if cfg.output:
        with exit_on_user_error():
            atomic_write_text(cfg.output, json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
