"""One run: data and tokenizer -> model -> training -> test BLEU and sample translations, in one
process or, started by torchrun, in several (distributed.py). members.py runs several of these."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import sys
import time
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from .. import checkpoint
from ..data import clean_training_pairs, corpus_file, load_split, primary_rows, training_text
from ..data.batching import TokenizedCorpus, filter_long, tokenize, tokenize_mapped
from ..data.sampling import language_text, resample
from ..data.tokenizer import Tokenizer, tag_piece
from ..devices import autocast_dtype, pick_device
from ..errors import USER_ERRORS, CheckpointError, DataError
from ..fast import accelerate
from ..files import write_texts
from ..model import Transformer, count_parameters
from ..translator import Translator
from . import distributed, finetune
from .checkpoints import to_plain
from .resume import check_compatible, clear_run, make_deterministic, remove_unfinished, resume_path
from .testing import evaluate_tests, report
from .trainer import Trainer
from .validation import split_scores

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_tokenizer(cfg, train_ds) -> Tokenizer:
    """The joint SentencePiece model of both sides of the training split, or with
    data.joint_vocab=false one model per side; a resumed run takes them from its checkpoint instead."""
    started = time.monotonic()
    if cfg.data.multilingual:  # every language once, at data.temperature; a tag per target language
        text = language_text(train_ds, cfg.data.temperature, cfg.seed)
        tags = [tag_piece(lang) for lang in dict.fromkeys(t for _, t in cfg.data.pairs)]
        tokenizer = Tokenizer.train(text, cfg.data.vocab_size, cfg.data.spm_model_type, symbols=tags)
        log.info("trained a %d-piece %s tokenizer on %d sentences of %s, with tags %s in %.1fs", len(tokenizer), cfg.data.spm_model_type, len(text), ", ".join(cfg.data.languages), " ".join(tags), time.monotonic() - started)  # fmt: skip
        return tokenizer
    sides = [("src", "tgt")] if cfg.data.joint_vocab else [("tgt",), ("src",)]
    models = []
    targets_once = primary_rows(train_ds, cfg.data.src_lang)  # data.extra_src_langs repeats the targets
    for columns in sides:
        if cfg.data.streaming:
            if targets_once is train_ds:  # one pass, both sides batch by batch
                text = training_text(train_ds, columns)
            else:
                text = chain.from_iterable(training_text(targets_once if c == "tgt" else train_ds, (c,)) for c in columns)  # fmt: skip
            models.append(Tokenizer.train(text, cfg.data.vocab_size, cfg.data.spm_model_type, cfg.data.spm_sample))
        else:
            text = [line for c in columns for line in (targets_once if c == "tgt" else train_ds)[c]]
            models.append(Tokenizer.train(text, cfg.data.vocab_size, cfg.data.spm_model_type))
    tokenizer = Tokenizer(models[0].model_bytes, None if cfg.data.joint_vocab else models[1].model_bytes)
    what = f"a {len(tokenizer)}-piece {cfg.data.spm_model_type} tokenizer"
    if not tokenizer.joint:
        sizes = f"{len(tokenizer.source)} pieces for the source and {len(tokenizer)} for the target"
        what = f"{cfg.data.spm_model_type} tokenizers of {sizes}"
    log.info("trained %s in %.1fs", what, time.monotonic() - started)
    return tokenizer


def build_model(cfg, tokenizer: Tokenizer, device: torch.device) -> Transformer:
    src_vocab = None if tokenizer.joint else len(tokenizer.source)
    model_cfg = dataclasses.replace(
        cfg.model, vocab_size=len(tokenizer), src_vocab_size=src_vocab, pad_id=tokenizer.pad_id
    )
    model = Transformer(model_cfg).to(device)
    log.info("model: %s parameters, %s", f"{count_parameters(model):,}", model_cfg)
    return model


def prepare_data(cfg, tokenizer: Tokenizer | None) -> tuple[Tokenizer, TokenizedCorpus, TokenizedCorpus]:
    """Training and validation splits as token ids; the tokenizer is trained unless given. The
    test splits are checked to exist, so that a missing one fails now, not after training."""
    train_ds = clean_training_pairs(load_split(cfg.data, cfg.data.train_split), cfg.data.train_split)
    valid_ds = load_split(cfg.data, cfg.data.valid_split)
    if not cfg.data.hub_name and not cfg.data.multilingual:  # a many-to-many run tests the directions a split has
        for split in cfg.data.test_splits:
            for lang in (cfg.data.src_lang, cfg.data.tgt_lang):
                corpus_file(Path(cfg.data.dir), split, lang)
    if tokenizer is None:
        tokenizer = train_tokenizer(cfg, train_ds)
    check_tags(cfg, tokenizer)
    if cfg.data.multilingual:
        train_ds = resample(train_ds, cfg.data.temperature, cfg.seed)
    if cfg.data.streaming:
        tokenized = tokenize_mapped(train_ds, tokenizer, cfg.data.tgt_lang)
    else:
        tokenized = tokenize(train_ds, tokenizer, cfg.data.tgt_lang)
    train = filter_long(tokenized, cfg.data.max_len)
    if len(train) == 0:
        raise DataError(
            f"no training pairs left: all {len(tokenized)} pairs of split {cfg.data.train_split!r} have a side "
            f"longer than data.max_len={cfg.data.max_len} tokens"
        )
    if cfg.data.multilingual:
        counts = ", ".join(f"{name} {len(rows)}" for name, rows in train.directions().items())
        log.info("%d training pairs in %d directions (%s), %d validation pairs", len(train), len(cfg.data.pairs), counts, len(valid_ds))  # fmt: skip
    else:
        sources = ", ".join([cfg.data.src_lang, *cfg.data.extra_src_langs])
        log.info("%d training pairs (%s -> %s), %d validation pairs", len(train), sources, cfg.data.tgt_lang, len(valid_ds))  # fmt: skip
    return tokenizer, train, tokenize(valid_ds, tokenizer, cfg.data.tgt_lang)


def check_tags(cfg, tokenizer: Tokenizer) -> None:
    """A many-to-many run needs a tokenizer (its own, or a fine-tuned checkpoint's) with a tag for
    every target language; a tokenizer with tags tags every source, a bilingual run's too."""
    targets = [t for _, t in cfg.data.pairs]
    missing = sorted({t for t in targets if t not in tokenizer.target_tags})
    if missing and (cfg.data.multilingual or tokenizer.target_tags):
        has = ", ".join(sorted(tokenizer.target_tags)) or "none"
        raise DataError(f"the tokenizer has no target tag for {', '.join(missing)} (its tags: {has}); a checkpoint given as init_from brings its own tokenizer")  # fmt: skip


def checkpoint_to_resume(cfg, run_dir: Path) -> dict | None:
    """The checkpoint this run continues from (trainer.resume, or the run directory's own), checked
    to hold the same configuration; None for a fresh start."""
    path = resume_path(cfg.trainer.resume, run_dir, cfg.trainer.overwrite)
    if path is None:
        return None
    payload = checkpoint.load(path) | {"path": str(path)}
    if "train_state" not in payload:
        raise CheckpointError(f"{path} holds weights only (no optimizer state); it cannot be resumed")
    defaults = to_plain(type(cfg)())  # for options newer than the checkpoint
    check_compatible(path, payload["train_config"], to_plain(cfg), bool(cfg.trainer.resume), defaults)
    return payload


def evaluate_average(
    cfg, run_dir: Path, model: Transformer, tokenizer: Tokenizer, valid, device, tests: bool = True
) -> dict:
    """Average the last trainer.average_last numbered checkpoints into checkpoint_avg<N>.pt and
    score it on the validation split (greedy, as checkpoints are selected) and the test splits."""
    paths = checkpoint.numbered(run_dir)[-cfg.trainer.average_last :]
    if len(paths) < 2:
        log.info("not averaging: %d numbered checkpoint(s)", len(paths))
        return {}
    name = f"avg{len(paths)}"
    averaged = checkpoint.average(paths)
    checkpoint.write(run_dir / f"checkpoint_{name}.pt", averaged)
    model.load_state_dict(averaged["model"])
    translator = Translator.of_training(model, tokenizer, cfg.decode, cfg.runtime.precision)
    hyps = translator.translate_corpus(valid, cfg.decode.greedy())
    valid_bleu = split_scores(hyps, valid)[0]
    report(
        f"averaged the checkpoints of steps {', '.join(str(checkpoint.step_of(p)) for p in paths)} into "
        f"checkpoint_{name}.pt: validation BLEU {valid_bleu:.2f} (greedy)"
    )
    summary = {"average": {"checkpoints": [p.name for p in paths], "valid_bleu": valid_bleu}}
    if tests:
        summary[f"test_{name}"] = evaluate_tests(cfg, run_dir, translator, tag=f"{name}.")
    return summary


def join_world(cfg, run_dir: Path) -> tuple[distributed.World, torch.device, Path]:
    """Start data parallelism when launched by torchrun. Every rank takes rank 0's run directory
    (Hydra names one per process from the clock) and ranks other than 0 log warnings only."""
    device = pick_device(cfg.trainer.device)
    world = distributed.start(device)
    if not world.distributed:
        return world, device, run_dir
    main_dir = Path(world.broadcast(str(run_dir)))
    if not world.is_main:
        logging.getLogger().setLevel(logging.WARNING)
        if main_dir.resolve() != run_dir.resolve():
            remove_hydra_only_dir(run_dir)
    return world, world.device(device), main_dir


def remove_hydra_only_dir(run_dir: Path) -> None:
    """The directory Hydra made for a rank other than 0, if it holds nothing but Hydra's files."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", "train.log"}:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_one(
    cfg, run_dir: Path, tests: bool = True, tokenizer: Tokenizer | None = None, record: dict | None = None
) -> dict:
    """Train (or resume) one model, then evaluate its best checkpoint on the test splits (unless
    tests=False). Returns the test scores (on rank 0; other ranks of a distributed run return an
    empty dict after training). A given tokenizer is used instead of training one (members share
    their parent's). `record`: {file name: text} written under run_dir/.hydra once the run is known
    to start."""
    world, device, run_dir = join_world(cfg, Path(run_dir))
    try:
        return run_in_world(cfg, run_dir, world, device, tests, tokenizer, record)
    finally:
        distributed.stop(world)


def prepare_in_world(
    cfg, run_dir: Path, world: distributed.World, tokenizer: Tokenizer | None = None, record: dict | None = None
):
    """(checkpoint to resume or None, tokenizer, train, valid). Rank 0 alone checks what to resume,
    loads the data and trains the tokenizer, and only then, the run known to start, touches the run
    directory (start_run); the others then read what it decided (and stop quietly if it refused
    the run)."""
    resumed, failure = None, None
    if world.is_main:
        try:
            resumed = checkpoint_to_resume(cfg, run_dir)
            init = finetune.load_init(cfg.init_from) if cfg.init_from and not resumed else None
            saved = resumed or init  # the tokenizer of the run resumed, or of the checkpoint fine-tuned
            saved_tokenizer = checkpoint.tokenizer_of(saved) if saved else tokenizer
            tokenizer, train, valid = prepare_data(cfg, saved_tokenizer)
            start_run(cfg, run_dir, tokenizer, resumed["step"] if resumed else 0, record, init)
        except USER_ERRORS as e:
            failure = e
    failed, resume_file = world.broadcast((failure is not None, resumed["path"] if resumed else None))
    if failure:
        raise failure
    if failed:
        sys.exit(2)  # rank 0 has printed the error
    if not world.is_main:
        resumed = checkpoint.load(resume_file) if resume_file else None
        tokenizer, train, valid = prepare_data(cfg, Tokenizer.load(run_dir / "spm.model"))
    return resumed, tokenizer, train, valid


def start_run(
    cfg, run_dir: Path, tokenizer: Tokenizer, step: int, record: dict | None, init: dict | None = None
) -> None:
    """The first change to the run directory: an earlier run cleared (trainer.overwrite), what a
    killed one left after `step` removed, the tokenizer saved, `record` ({file name: text}, the
    composed config) written under .hydra/ and, for a fine-tuning run's start, the checkpoint it
    starts from recorded in init_from.json."""
    if cfg.trainer.overwrite and not cfg.trainer.resume:
        clear_run(run_dir)
    remove_unfinished(run_dir, step)
    tokenizer.save(run_dir / "spm.model")
    write_texts(run_dir / ".hydra", record or {})
    if init is not None:
        finetune.record_origin(run_dir, init)


def training_summary(trainer: Trainer, best: dict, run_dir: Path) -> dict:
    """Report how training went, and return it for results.json (the test scores join it later)."""
    state = trainer.state
    step_seconds = max(state.train_seconds - state.valid_seconds, 1e-9)
    report(
        f"trained {state.step} steps ({state.epoch - 1} full epochs) in {state.train_seconds / 60:.1f} min "
        f"({state.valid_seconds / 60:.1f} of them validating), "
        f"{state.train_tokens / step_seconds:.0f} source+target tokens/s; "
        f"best checkpoint: step {best['step']} ({run_dir / 'checkpoint_best.pt'})"
    )
    return {
        "parameters": count_parameters(trainer.model),
        "steps": state.step,
        "epochs": state.epochs_done(len(trainer.batches.epoch_batches(state.epoch))),
        "train_minutes": state.train_seconds / 60,
        "valid_minutes": state.valid_seconds / 60,
        "tokens_per_s": state.train_tokens / step_seconds,
        "autocast": str(trainer.amp_dtype).replace("torch.", "") if trainer.amp_dtype else "fp32",
        "best_step": best["step"],
        "valid_best": state.best_score,
    }


def run_in_world(
    cfg,
    run_dir: Path,
    world: distributed.World,
    device: torch.device,
    tests: bool = True,
    tokenizer: Tokenizer | None = None,
    record: dict | None = None,
) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    if cfg.trainer.deterministic:
        make_deterministic()
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    log.info(
        "run directory %s, device %s, autocast %s%s",
        run_dir,
        device,
        autocast_dtype(cfg.trainer.precision, device),
        f", {world.size} processes" if world.distributed else "",
    )
    resumed, tokenizer, train, valid = prepare_in_world(cfg, run_dir, world, tokenizer, record)
    model = accelerate(build_model(cfg, tokenizer, device), training_runtime(cfg.runtime))  # before any weights load
    if cfg.init_from and not resumed:  # a fine-tuning run's start; every rank reads the weights
        finetune.load_weights(model, finetune.load_init(cfg.init_from))
    finetune.freeze(model, cfg.trainer.freeze)
    trainer = Trainer(cfg, run_dir, model, tokenizer, train, valid, world)
    if resumed:
        trainer.restore(resumed)
    if world.is_main:
        trainer.monitor.start(trainer.state.step)
        trainer.checkpoints.restore_best(trainer.state)
    if world.rank:  # different dropout on each rank; rank 0 draws exactly as a single process would
        torch.manual_seed(cfg.seed + 1000 * world.rank + trainer.state.step)
    trainer.fit()
    world.barrier()
    results = evaluate_best(cfg, run_dir, trainer, model, tokenizer, valid, device, tests) if world.is_main else {}
    world.barrier()  # every rank leaves together: none tears down its connections while rank 0 still works
    return results


def training_runtime(runtime):
    """The speed paths of a model in training: runtime's, but its validations decode without a
    compiled step. A compiled program holds the weights it was compiled with (fast/compiled.py),
    and they change between validations: each would compile again, on the training budget. The
    test splits, decoded after training, use runtime.compiled_step (evaluate_best)."""
    if runtime.compiled_step:
        log.info("runtime.compiled_step=true: validations decode with eager steps (the weights change between them); the test splits use the compiled step")  # fmt: skip
    return dataclasses.replace(runtime, compiled_step=False)


def evaluate_best(
    cfg, run_dir: Path, trainer: Trainer, model, tokenizer: Tokenizer, valid, device, tests: bool
) -> dict:
    """Rank 0's end of a run: the best checkpoint's test scores, results.json and the hparams."""
    best = checkpoint.load(run_dir / "checkpoint_best.pt", device)
    if cfg.runtime.compiled_step:  # a model of its own, with the compiled step training went without
        model = accelerate(build_model(cfg, tokenizer, device), cfg.runtime)
    model.load_state_dict(best["model"])
    summary = training_summary(trainer, best, run_dir)
    results = (
        evaluate_tests(cfg, run_dir, Translator.of_training(model, tokenizer, cfg.decode, cfg.runtime.precision))
        if tests
        else {}
    )
    summary["test"] = results
    (run_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.trainer.average_last:
        summary |= evaluate_average(cfg, run_dir, model, tokenizer, valid, device, tests)
        (run_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    metrics = {f"{name}/bleu": r["bleu"] for name, r in results.items()} | {"valid/best": trainer.state.best_score}
    trainer.monitor.hparams(to_plain(cfg), metrics)
    trainer.monitor.close()
    return results
