"""Several models trained at once and ensembled: `trainer.members=N`.

On a CPU with few cores, N independent runs side by side, each on cores/N threads, train more
tokens per second in total than one run on all of them, and averaging the next-token
distributions of independently trained models is worth more BLEU than the extra steps one model
would get (docs/RESULTS.md). Member i is the same run with seed `seed + i`, in `member<i>/` of the
run directory, where it keeps its own log, TensorBoard events and checkpoints, and resumes by
itself when the command is run again. When all have finished, the validation split chooses the
ensemble to report (of the members' best checkpoints, their averages, or both) with the configured
decoding, and only the chosen one is scored on the test splits.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from ..data import clean_training_pairs, load_split, write_lines
from ..data.batching import tokenize
from ..data.tokenizer import Tokenizer
from ..errors import ConfigError, TrainingStopped, exit_on_user_error
from ..files import write_texts
from ..translator import Translator
from .experiment import run_one, train_tokenizer
from .resume import GracefulStop
from .testing import evaluate_tests, hypotheses_path, report
from .validation import split_scores

log = logging.getLogger(__name__)


def member_configs(cfg) -> list:
    """One config per member: seed + i, and an equal share of the CPU threads."""
    n = cfg.trainer.members
    threads = max(1, (cfg.trainer.threads or torch.get_num_threads()) // n)
    return [
        dataclasses.replace(
            cfg, seed=cfg.seed + i, trainer=dataclasses.replace(cfg.trainer, members=1, threads=threads)
        )
        for i in range(n)
    ]


def train_member(cfg, run_dir: Path, index: int, tokenizer_bytes: tuple[bytes, bytes | None]) -> None:
    """A member's process: its log goes to its own train.log and, prefixed, to the parent's stdout."""
    stop_when_orphaned(os.getppid())
    run_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"[%(asctime)s] member{index}: %(message)s", "%H:%M:%S")
    handlers = [logging.FileHandler(run_dir / "train.log"), logging.StreamHandler(sys.stdout)]
    for handler in handlers:
        handler.setFormatter(fmt)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)
    with exit_on_user_error():
        try:
            run_one(cfg, run_dir, tests=False, tokenizer=Tokenizer(*tokenizer_bytes))
        except TrainingStopped as e:
            if e.exit_code <= 128:
                raise
            # Interrupted: logged without the resume command for this member alone; the parent
            # gives the one for the whole command.
            log.info("%s", e.what)
            sys.exit(e.exit_code)


def stop_when_orphaned(parent: int, every: float = 1.0) -> None:
    """Send this member SIGTERM (it saves and stops at its next step, as GracefulStop does) once
    the process that started it is gone, say killed with SIGKILL: a member must not go on training
    alone, into a directory that a rerun of the command would resume."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def join_forwarding_signals(processes: list, stop: GracefulStop) -> None:
    """Wait for every member, passing a SIGTERM or SIGINT sent to this process on to each of them
    (once), so that each saves its checkpoint and stops at its next step."""
    forwarded = False
    while any(p.is_alive() for p in processes):
        if stop.requested and not forwarded:
            for process in processes:
                if process.is_alive():
                    os.kill(process.pid, stop.signum)
            forwarded = True
        for process in processes:
            process.join(timeout=0.2)


def shared_tokenizer(cfg, run_dir: Path):
    """The tokenizer every member starts from, trained once (run_dir/spm.model, kept for reruns):
    an ensemble needs one vocabulary, and data errors show before any member starts."""
    if (run_dir / "spm.model").exists() and not cfg.trainer.overwrite:
        return Tokenizer.load(run_dir / "spm.model")
    train_ds = clean_training_pairs(load_split(cfg.data, cfg.data.train_split), cfg.data.train_split)
    tokenizer = train_tokenizer(cfg, train_ds)
    tokenizer.save(run_dir / "spm.model")
    return tokenizer


def train_members(cfg, run_dir: Path) -> list[Path]:
    """Start every member, wait for all, and return their run directories."""
    tokenizer = shared_tokenizer(cfg, run_dir)
    configs = member_configs(cfg)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copied thread pools
    dirs = [run_dir / f"member{i}" for i in range(cfg.trainer.members)]
    processes = [
        context.Process(
            target=train_member,
            args=(c, d, i, (tokenizer.model_bytes, tokenizer.source_bytes, tokenizer.vocabulary)),
            name=f"member{i}",
        )
        for i, (c, d) in enumerate(zip(configs, dirs))
    ]
    log.info("training %d members at once, %d thread(s) each", len(processes), configs[0].trainer.threads)
    with GracefulStop() as stop:
        for process in processes:
            process.start()
        join_forwarding_signals(processes, stop)
    if stop.requested:
        raise TrainingStopped(
            f"interrupted by signal {int(stop.signum)}; every member saved its checkpoint_last.pt in {run_dir}/member<i>",
            exit_code=128 + int(stop.signum),
            resume_dir=run_dir,
        )
    failed = [p.name for p in processes if p.exitcode != 0]
    if failed:
        raise TrainingStopped(f"error: {', '.join(failed)} stopped without finishing (see its train.log)", 1)
    return dirs


def member_average(member_dir: Path) -> Path | None:
    """The averaged checkpoint the member's last run wrote (its results.json names the checkpoints
    averaged), or None: a file left by an earlier run with another trainer.average_last is not it."""
    average = json.loads((member_dir / "results.json").read_text()).get("average")
    return member_dir / f"checkpoint_avg{len(average['checkpoints'])}.pt" if average else None


def candidates(dirs: list[Path]) -> dict[str, list[Path]]:
    """The ensembles validation chooses from: every member's best checkpoint, every member's
    average of its last checkpoints, and both together (averages only where every member has one)."""
    best = [d / "checkpoint_best.pt" for d in dirs]
    averages = [member_average(d) for d in dirs]
    if not all(averages):
        return {"best": best}
    name = averages[0].stem.split("_")[1]  # avg<N>
    return {"best": best, name: averages, f"best+{name}": best + averages}


def load_ensemble(paths: list[Path], cfg) -> Translator:
    """The ensemble of the checkpoints, as translate.py loads one."""
    return Translator.load(paths[0], [str(p) for p in paths[1:]], cfg.trainer.device, cfg.decode, cfg.runtime)


def choose_on_validation(cfg, options: dict[str, list[Path]], valid_split) -> tuple[str, dict, list[str]]:
    """(the name of the ensemble with the highest validation BLEU, every option's score, the
    chosen ensemble's translations of the validation split)."""
    scores, translations, corpus = {}, {}, None
    for name, paths in options.items():
        started = time.monotonic()
        translator = load_ensemble(paths, cfg)
        if corpus is None:  # every option holds the same members, so one tokenizer
            corpus = tokenize(valid_split, translator.tokenizer, cfg.data.tgt_lang)
        translations[name] = translator.translate_corpus(corpus)
        scores[name] = split_scores(translations[name], corpus)[0]  # a many-to-many run's: the directions' mean
        report(
            f"ensemble {name} ({len(paths)} checkpoints): validation BLEU {scores[name]:.2f} "
            f"({cfg.decode.label}, {time.monotonic() - started:.0f}s)"
        )
    chosen = max(scores, key=scores.get)  # the first listed wins a tie: the fewest checkpoints
    return chosen, scores, translations[chosen]


def run_members(cfg, run_dir: Path, record: dict | None = None) -> dict:
    """Train the members, choose their ensemble on validation, score it on the test splits and
    write results.json (the members' own summaries included)."""
    if cfg.trainer.resume:
        raise ConfigError("trainer.resume names one run; with trainer.members > 1 run the same command again instead")
    started = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_texts(run_dir / ".hydra", record or {})
    dirs = train_members(cfg, run_dir)
    options = candidates(dirs)
    chosen, valid_scores, valid_hyps = choose_on_validation(cfg, options, load_split(cfg.data, cfg.data.valid_split))
    label = f"ensemble.{cfg.decode.label}"  # beside the test splits' translations (evaluate_tests)
    write_lines(hypotheses_path(run_dir, cfg.data.valid_split, label, cfg.data.tgt_lang), valid_hyps)
    report(f"validation chose the ensemble {chosen}: {', '.join(str(p.relative_to(run_dir)) for p in options[chosen])}")
    results = evaluate_tests(cfg, run_dir, load_ensemble(options[chosen], cfg), tag="ensemble.")
    summary = {
        "members": [json.loads((d / "results.json").read_text()) for d in dirs],
        "ensembles": {
            name: {"checkpoints": [str(p.relative_to(run_dir)) for p in paths], "valid_bleu": valid_scores[name]}
            for name, paths in options.items()
        },
        "chosen": chosen,
        "valid_best": valid_scores[chosen],
        "test": results,
        "wall_minutes": (time.monotonic() - started) / 60,
    }
    (run_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    report(f"finished in {summary['wall_minutes']:.1f} min")
    return results
