"""Sequence-level knowledge distillation (Kim and Rush, 2016), the stages of distill.py.

    translate  the teacher (a checkpoint or an ensemble) translates the training sources with the
               run's decode settings, distill.chunk_lines at a time, its progress saved after each
               chunk: RUN/translate/{split}.{tgt} as translate.py writes it, and a per-piece
               log-probability for each translation in {split}.{tgt}.scores
    filter     drops empty translations, copies of the source, pairs of unlikely length ratio and
               the teacher's least confident ones; optionally adds the references: RUN/corpus/,
               the student's corpus (its validation and test splits copied from data.dir)
    train      the student trains on RUN/corpus with the teacher's tokenizer (train.py's run, so
               it resumes and evaluates as any run does): RUN/student/
    shortlist  the student's lexical shortlist from the distilled pairs: RUN/student/shortlist.tsv

Each stage writes manifest.json when it completes: its inputs (digests of the files it read, the
settings it used), its outputs' digests and its wall time. A stage whose manifest matches its
inputs and outputs is skipped, so running the same command again in the same run directory goes
on from the stage a killed run reached; a stage that holds the output of other inputs is refused
(distill.overwrite=true redoes it). distill.py deletes only what it wrote: a stage directory holding
anything but no record of its stage stops the run, distill.overwrite or not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from ..checkpoint import direction, language_pair, tokenizer_of
from ..data.corpus import corpus_file, has_corpus_file, read_lines
from ..decoding.shortlist import build_for, shortlist_path
from ..errors import ConfigError, DataError, TrainingStopped
from ..files import atomic_write_text
from ..monitoring import progress_bar
from ..translator import Translator, output_lines
from .checkpoints import to_plain
from .finetune import load_init
from .launch import run
from .resume import GracefulStop
from .testing import report

log = logging.getLogger(__name__)

STAGES = ("translate", "filter", "train", "shortlist")
DIRECTORIES = {"translate": "translate", "filter": "corpus", "train": "student", "shortlist": "student"}
RESUME = "Resume with: python distill.py <same overrides> hydra.run.dir={}"


def digest(path: Path) -> str:
    """The sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Stage:
    """A stage's directory and its record: inputs.json while it runs, manifest.json once done.
    `owns` is what redoing the stage deletes: its directory, or the one file of a stage that
    shares another's directory (the shortlist, in student/)."""

    def __init__(self, directory: Path, name: str, inputs: dict, overwrite: bool, owns: Path | None = None):
        self.directory, self.name, self.inputs, self.overwrite = directory, name, inputs, overwrite
        self.manifest_path = directory / "manifest.json"
        self.inputs_path = directory / "inputs.json"
        self.owns = owns or directory

    def read(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def earlier(self) -> dict | None:
        """The inputs of this stage's record in its directory, None when it has none."""
        return self.read(self.inputs_path) or (self.read(self.manifest_path) or {}).get("inputs")

    def complete(self) -> dict | None:
        """The manifest, when the stage ran to its end on these inputs and its outputs are as it left them."""
        manifest = self.read(self.manifest_path)
        if manifest is None or manifest.get("inputs") != self.inputs:
            return None
        outputs = manifest.get("outputs", {})
        if all((self.directory / name).is_file() and digest(self.directory / name) == sha for name, sha in outputs.items()):  # fmt: skip
            return manifest
        return None

    def refuse_foreign(self) -> None:
        """Stops the run when what the stage would delete holds something but no record of this
        stage: distill.py deletes only what it wrote. A record's temporary file, left by a kill
        while the stage was writing its first record, is the stage's own."""
        records = (f".{self.inputs_path.name}.", f".{self.manifest_path.name}.")
        owns = self.owns
        held = [owns] if owns.is_file() else list(owns.iterdir()) if owns.is_dir() else []
        if self.earlier() is None and any(not (p.name.startswith(records) and p.name.endswith(".tmp")) for p in held):
            holder = "it" if owns == self.directory else str(self.directory)
            raise ConfigError(f"{owns} was not written by distill.py ({holder} has no record of its {self.name} stage, {self.manifest_path.name} or {self.inputs_path.name}), so it will not delete it: move it away or choose another hydra.run.dir")  # fmt: skip

    def start(self) -> bool:
        """Prepare to run: True when a killed run of the same inputs left progress to go on from.
        Refuses what holds no record of this stage, and the stage of other inputs unless
        distill.overwrite, when what it owns is deleted."""
        earlier = self.earlier()
        if earlier is None:
            self.refuse_foreign()
        elif earlier != self.inputs:
            if not self.overwrite:
                changed = differing(earlier, self.inputs)
                raise ConfigError(f"{self.directory} holds the {self.name} stage of other inputs (they differ in {', '.join(changed)}); choose another hydra.run.dir, or set distill.overwrite=true to redo it")  # fmt: skip
            self.clear()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.manifest_path.unlink(missing_ok=True)
        resumed = earlier == self.inputs
        atomic_write_text(self.inputs_path, json.dumps(self.inputs, indent=1) + "\n")
        return resumed

    def clear(self) -> None:
        """Deletes what the stage owns but its record (start rewrites it), the records (.json) of
        stages within it last: a run killed midway leaves nothing that looks unrecorded."""
        if not self.owns.is_dir():
            self.owns.unlink(missing_ok=True)
            return
        for path in sorted(self.owns.iterdir(), key=lambda p: p.suffix == ".json"):
            if path in (self.manifest_path, self.inputs_path):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

    def finish(self, outputs: list[Path], seconds: float, **facts) -> dict:
        manifest = {"stage": self.name, "inputs": self.inputs, "seconds": round(seconds, 1), **facts}
        manifest["outputs"] = {str(p.relative_to(self.directory)): digest(p) for p in outputs}
        atomic_write_text(self.manifest_path, json.dumps(manifest, indent=1) + "\n")
        self.inputs_path.unlink(missing_ok=True)
        return manifest


def stage_of(name: str, run_dir: Path, inputs: dict | None = None, overwrite: bool = False) -> Stage:
    """`name`'s Stage in run_dir: translate/, corpus/ (filter), student/ (train); the shortlist
    shares student/ with train, its record in shortlist.json, and owns only its file."""
    directory = run_dir / DIRECTORIES[name]
    if name != "shortlist":
        return Stage(directory, name, inputs or {}, overwrite)
    stage = Stage(directory, name, inputs or {}, overwrite, owns=shortlist_path(directory / "checkpoint_best.pt"))
    stage.manifest_path, stage.inputs_path = directory / "shortlist.json", directory / "shortlist.inputs.json"
    return stage


def differing(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The keys (dotted, nested ones named in full) whose values differ between a and b."""
    out, absent = [], object()  # a key only one side has differs, whatever the other's value
    for key in sorted({*a, *b}):
        x, y = a.get(key, absent), b.get(key, absent)
        if isinstance(x, dict) and isinstance(y, dict):
            out += differing(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}")
    return out


# --- the teacher --------------------------------------------------------------------------------


def check_data(cfg) -> None:
    if cfg.data.hub_name or cfg.data.directions or cfg.data.extra_src_langs:
        raise ConfigError("distill.py distills one direction of a local corpus: it cannot be used with data.hub_name, data.directions or data.extra_src_langs")  # fmt: skip


def load_teacher(cfg) -> Translator:
    """The teacher (cfg.teacher, ensembled with cfg.ensemble), decoding with the run's decode
    settings and distill.n_best; refused when it translates another direction than data's."""
    decode = dataclasses.replace(cfg.decode, n_best=cfg.distill.n_best, shortlist=False)
    teacher = Translator.load(cfg.teacher, cfg.ensemble, cfg.trainer.device, decode, cfg.runtime)
    pair = language_pair(teacher.payload.get("train_config"))
    wanted = ((cfg.data.src_lang,), cfg.data.tgt_lang)
    if teacher.directions or (pair is not None and pair != wanted):
        has = ", ".join(teacher.directions) if teacher.directions else direction(pair)
        raise ConfigError(f"teacher={cfg.teacher} translates {has}, but the student is to translate {direction(wanted)} (data.src_lang, data.tgt_lang)")  # fmt: skip
    if teacher.tokenizer.target_tags:
        raise ConfigError(f"teacher={cfg.teacher} has target-language tags: distill.py distills one direction without them")  # fmt: skip
    if cfg.init_from:
        if not tokenizer_of(load_init(cfg.init_from)).same_as(teacher.tokenizer):
            raise ConfigError(f"init_from={cfg.init_from} has another tokenizer than teacher={cfg.teacher}: the student reads the teacher's pieces")  # fmt: skip
    return teacher


# --- translate ----------------------------------------------------------------------------------


def translate_stage(cfg, teacher: Translator, run_dir: Path) -> dict:
    """The teacher's translations of the training sources, resumable chunk by chunk."""
    source = corpus_file(Path(cfg.data.dir), cfg.data.train_split, cfg.data.src_lang)
    teachers = [cfg.teacher, *cfg.ensemble]
    inputs = {
        "teacher": {str(p): digest(Path(p)) for p in teachers},
        "source": {str(source): digest(source)},
        "decode": to_plain(teacher.decode),
        "runtime": to_plain(cfg.runtime),
    }
    stage = stage_of("translate", run_dir, inputs, cfg.distill.overwrite)
    directory, done = stage.directory, stage.complete()
    if done:
        report(f"translate: done before ({done['lines']} sources, {directory})")
        return done
    resumed = stage.start()
    outputs = [directory / f"{cfg.data.train_split}.{cfg.data.tgt_lang}", directory / f"{cfg.data.train_split}.{cfg.data.tgt_lang}.scores"]  # fmt: skip
    progress = (stage.read(directory / "progress.json") or {}) if resumed else {}
    first, seconds = progress.get("lines", 0), progress.get("seconds", 0.0)
    for path, size in zip(outputs, progress.get("sizes", [0, 0])):
        with open(path, "ab") as f:
            f.truncate(size)  # what a chunk killed before its progress was saved wrote goes
    lines = read_lines(source)
    if first:
        report(f"translate: going on from source line {first + 1} of {len(lines)}")
    started = time.monotonic()
    with GracefulStop() as stop, progress_bar(len(lines), "translate", initial=first) as bar:
        for start in range(first, len(lines), cfg.distill.chunk_lines):
            chunk = lines[start : start + cfg.distill.chunk_lines]
            n_best = teacher.translate_texts(chunk, None, bar, str(source), start + 1)
            texts = output_lines(n_best, teacher.tokenizer, teacher.decode.n_best, start)
            kept = [hyps[: teacher.decode.n_best] for hyps in n_best]  # what output_lines writes
            scores = [f"{h.log_prob / (len(h.tokens) + 1):.4f}" for hyps in kept for h in hyps]
            for path, rows in zip(outputs, (texts, scores)):
                with open(path, "ab") as f:
                    f.write("".join(row + "\n" for row in rows).encode("utf-8"))
                    f.flush()
                    os.fsync(f.fileno())
            end = start + len(chunk)
            elapsed = seconds + time.monotonic() - started
            state = {"lines": end, "sizes": [p.stat().st_size for p in outputs], "seconds": elapsed}
            atomic_write_text(directory / "progress.json", json.dumps(state) + "\n")
            log.info("translate: %d of %d sources (%.0f sent/s)", end, len(lines), (end - first) / max(elapsed - seconds, 1e-9))  # fmt: skip
            if stop.requested and end < len(lines):
                raise TrainingStopped(f"interrupted by signal {stop.signum} after {end} of {len(lines)} sources; {RESUME.format(run_dir)}", 128 + stop.signum)  # fmt: skip
    (directory / "progress.json").unlink(missing_ok=True)
    manifest = stage.finish(outputs, seconds + time.monotonic() - started, lines=len(lines))
    report(f"translate: {len(lines)} sources in {manifest['seconds']:.0f} s -> {outputs[0]}")
    return manifest


def read_translations(path: Path, n_best: int, count: int) -> list[list[str]]:
    """translate.py's output as each source's list of translations."""
    rows = read_lines(path)
    if n_best == 1:
        return [[row] for row in rows]
    out = [[] for _ in range(count)]
    for row in rows:
        index, _, text = row.split("\t", 2) + [""] * max(0, 2 - row.count("\t"))
        out[int(index)].append(text)
    return out


# --- filter -------------------------------------------------------------------------------------


def filter_pairs(sources, references, translations, scores, tokenizer, cfg) -> tuple[list[tuple[str, str]], dict]:
    """The distilled pairs kept, and how many each rule dropped. `translations[i]` holds source
    i's translations, `scores[i]` their log-probabilities per piece. Rules, in order: empty,
    a copy of its source, a length ratio (in pieces) above cfg.max_length_ratio, then the
    cfg.drop_worst fraction of the rest with the lowest scores."""
    counts = dict.fromkeys(("translations", "empty", "copy", "length", "score", "kept", "references"), 0)
    candidates = []
    if cfg.select == "best":
        from sacrebleu.metrics import CHRF  # here: only this selection needs sacrebleu

        chrf = CHRF()
    for i, (source, texts, marks) in enumerate(zip(sources, translations, scores)):
        options = list(zip(texts, marks))
        if cfg.select == "best" and len(options) > 1:
            options = [max(options, key=lambda o: chrf.sentence_score(o[0], [references[i]]).score)]
        for text, score in options:
            counts["translations"] += 1
            if not text.strip() or not source.strip():
                counts["empty"] += 1
            elif " ".join(text.split()).lower() == " ".join(source.split()).lower():
                counts["copy"] += 1
            else:
                candidates.append((i, source, text, score))
    lengths = zip(tokenizer.source.encode([c[1] for c in candidates]), tokenizer.encode([c[2] for c in candidates]))
    ratio_ok = [max(len(s), len(t)) <= cfg.max_length_ratio * max(min(len(s), len(t)), 1) for s, t in lengths]
    counts["length"] = ratio_ok.count(False)
    candidates = [c for c, ok in zip(candidates, ratio_ok) if ok]
    dropped = int(cfg.drop_worst * len(candidates))
    worst = set(sorted(range(len(candidates)), key=lambda k: (candidates[k][3], k))[:dropped])
    counts["score"] = len(worst)
    pairs = [(c[1], c[2]) for k, c in enumerate(candidates) if k not in worst]
    counts["kept"] = len(pairs)
    if cfg.references:
        originals = [(s, r) for s, r in zip(sources, references) if s.strip() and r.strip()]
        pairs += originals
        counts["references"] = len(originals)
    return pairs, counts


def filter_stage(cfg, teacher: Translator, run_dir: Path, translated: dict) -> dict:
    """The student's corpus: the filtered distilled pairs as data.train_split, and data.dir's
    validation and test splits."""
    data = cfg.data
    src, tgt = data.src_lang, data.tgt_lang
    source = corpus_file(Path(data.dir), data.train_split, src)
    reference = corpus_file(Path(data.dir), data.train_split, tgt)
    copied = [corpus_file(Path(data.dir), split, lang) for split in (data.valid_split, *data.test_splits) for lang in (src, tgt) if has_corpus_file(Path(data.dir), split, lang)]  # fmt: skip
    settings = {k: v for k, v in to_plain(cfg.distill).items() if k in ("select", "max_length_ratio", "drop_worst", "references")}  # fmt: skip
    inputs = {"translations": translated["outputs"], "settings": settings, "files": {str(p): digest(p) for p in [source, reference, *copied]}}  # fmt: skip
    stage = stage_of("filter", run_dir, inputs, cfg.distill.overwrite)
    directory, done = stage.directory, stage.complete()
    if done:
        report(f"filter: done before ({done['counts']['kept']} distilled pairs, {directory})")
        return done
    started = time.monotonic()
    sources, references = read_lines(source), read_lines(reference)
    out_dir = run_dir / "translate"
    translations = read_translations(out_dir / f"{data.train_split}.{tgt}", cfg.distill.n_best, len(sources))
    marks, flat = iter(float(s) for s in read_lines(out_dir / f"{data.train_split}.{tgt}.scores")), []
    for texts in translations:
        flat.append([next(marks) for _ in texts])
    pairs, counts = filter_pairs(sources, references, translations, flat, teacher.tokenizer, cfg.distill)
    if counts["kept"] == 0:
        raise DataError(f"no distilled pair is left after filtering the {counts['translations']} translations ({counts['empty']} empty, {counts['copy']} copies, {counts['length']} over distill.max_length_ratio={cfg.distill.max_length_ratio}, {counts['score']} by distill.drop_worst={cfg.distill.drop_worst}); the teacher's translations stay in {out_dir}")  # fmt: skip
    stage.start()
    outputs = []
    for lang, side in ((src, 0), (tgt, 1)):
        path = directory / f"{data.train_split}.{lang}"
        atomic_write_text(path, "".join(pair[side] + "\n" for pair in pairs))
        outputs.append(path)
    for path in copied:
        shutil.copyfile(path, directory / path.name)
        outputs.append(directory / path.name)
    manifest = stage.finish(outputs, time.monotonic() - started, counts=counts)
    c = counts
    report(f"filter: kept {c['kept']} of {c['translations']} translations (dropped {c['empty']} empty, {c['copy']} copies, {c['length']} by length ratio, {c['score']} by teacher score), added {c['references']} references")  # fmt: skip
    return manifest


# --- train --------------------------------------------------------------------------------------


def train_stage(cfg, teacher: Translator, run_dir: Path, corpus: dict, student, record: dict | None) -> dict:
    """The student (`student`: its training Config, data.dir the distilled corpus), trained by
    train.py's run: it resumes from its own checkpoint_last.pt and evaluates its best checkpoint
    on the test splits."""
    inputs = {"corpus": corpus["outputs"], "config": to_plain(student)}
    stage = stage_of("train", run_dir, inputs, cfg.distill.overwrite)
    directory, done = stage.directory, stage.complete()
    if done:
        report(f"train: done before ({directory / 'checkpoint_best.pt'})")
        return done
    resumed = stage.start()
    if resumed and (directory / "checkpoint_last.pt").is_file():
        report(f"train: going on from {directory / 'checkpoint_last.pt'}")
    started = time.monotonic()
    try:
        results = run(student, directory, tokenizer=teacher.tokenizer, record=record)
    except TrainingStopped as e:
        raise TrainingStopped(f"{e.what}; {RESUME.format(run_dir)}", e.exit_code) from None
    outputs = [directory / "checkpoint_best.pt"]
    return stage.finish(outputs, time.monotonic() - started, test=results)


def shortlist_stage(cfg, teacher: Translator, run_dir: Path, corpus: dict) -> dict | None:
    """The student's shortlist, built from the distilled pairs (scripts/build_shortlist.py's defaults)."""
    if not cfg.distill.shortlist:
        return None
    inputs = {"corpus": corpus["outputs"], "first": 100, "best": 50, "rounds": 5}
    stage = stage_of("shortlist", run_dir, inputs, cfg.distill.overwrite)
    output, done = stage.owns, stage.complete()
    if done:
        report(f"shortlist: done before ({output})")
        return done
    stage.start()
    started = time.monotonic()
    tokenizer, corpus_dir = teacher.tokenizer, run_dir / "corpus"
    sources = read_lines(corpus_dir / f"{cfg.data.train_split}.{cfg.data.src_lang}")
    targets = read_lines(corpus_dir / f"{cfg.data.train_split}.{cfg.data.tgt_lang}")
    shortlist = build_for(tokenizer, sources, targets)  # scripts/build_shortlist.py's defaults
    shortlist.save(output, tokenizer.source.id_to_piece, tokenizer.id_to_piece)
    manifest = stage.finish([output], time.monotonic() - started)
    report(f"shortlist: {output} in {manifest['seconds']:.1f} s (decode.shortlist=true uses it)")
    return manifest


# --- the pipeline -------------------------------------------------------------------------------


def distill(cfg, run_dir: Path, student, record: dict | None = None) -> dict:
    """Every stage in order, each skipped when done before; returns the summary distill.json holds.
    `cfg`: the DistillRun; `student`: the Config the student trains with (DistillRun.student)."""
    check_data(cfg)
    if cfg.trainer.threads:  # every stage's, not only training's
        torch.set_num_threads(cfg.trainer.threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in STAGES if cfg.distill.shortlist else STAGES[:-1]:
        stage_of(name, run_dir).refuse_foreign()  # before any work: it would stop there
    teacher = load_teacher(cfg)
    report(f"distilling {teacher.language_pair or 'the teacher'} from {', '.join([cfg.teacher, *cfg.ensemble])} into {run_dir}; if stopped, {RESUME.format(run_dir)}")  # fmt: skip
    translated = translate_stage(cfg, teacher, run_dir)
    corpus = filter_stage(cfg, teacher, run_dir, translated)
    trained = train_stage(cfg, teacher, run_dir, corpus, student, record)
    shortlisted = shortlist_stage(cfg, teacher, run_dir, corpus)
    stages = {"translate": translated, "filter": corpus, "train": trained, "shortlist": shortlisted}
    summary = {name: {"seconds": m["seconds"]} for name, m in stages.items() if m}
    summary["filter"]["counts"] = corpus["counts"]
    summary["test"] = trained.get("test", {})
    summary["student"] = str(run_dir / "student" / "checkpoint_best.pt")
    atomic_write_text(run_dir / "distill.json", json.dumps(summary, indent=2) + "\n")
    times = ", ".join(f"{name} {summary[name]['seconds']:.0f} s" for name in STAGES if name in summary)
    report(f"distilled: {summary['student']} ({times}; the test scores in {run_dir / 'student' / 'results.json'})")
    return summary
