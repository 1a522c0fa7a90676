"""Surviving interruptions: random-number-generator state in checkpoints, exact resume checks,
graceful stop on SIGTERM/SIGINT, refusing to train into another run's directory, determinism."""

from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import numbered, step_of
from ..errors import ConfigError

# Settings that may change between an interrupted run and its resumption without changing what
# it computes: budgets, logging, where and whether to resume, and the speed paths (runtime).
RESUMABLE_CHANGES = {
    "trainer.resume", "trainer.overwrite", "trainer.max_steps", "trainer.max_epochs", "trainer.max_minutes", "trainer.max_tokens_seen",
    "trainer.patience", "trainer.log_every", "trainer.keep_last", "trainer.average_last", "trainer.device", "trainer.compile", "trainer.recompute", "trainer.max_bad_steps",
    "data.test_splits", "decode", "runtime",
}  # fmt: skip


def rng_states() -> dict:
    """Every random generator training may draw from, as tensors and plain values."""
    keys, pos, has_gauss, gauss = np.random.get_state()[1:]
    return {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    n = states["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(states["torch"].cpu())
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in states["cuda"]])


def make_deterministic() -> None:
    """Deterministic kernels everywhere (some GPU ops get slower; unsupported ones raise)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def flatten(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not any(name == k or name.startswith(k + ".") for k in RESUMABLE_CHANGES):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


BUDGET = {"trainer.max_steps", "trainer.max_epochs", "trainer.max_minutes", "trainer.max_tokens_seen"}


def config_differences(saved: dict, current: dict, defaults: dict | None = None) -> list[str]:
    """Keys whose values differ between a checkpoint's training config and the current one.

    A key the checkpoint lacks (an option newer than it) counts as its value in `defaults`; a key
    only the checkpoint has (an option since removed, e.g. trainer.chunked_loss) is ignored. The
    budget may change on resume, except when the learning-rate schedule or the dropout depends on it."""
    a, b, d = flatten(saved), flatten(current), flatten(defaults or {})
    trainer = current.get("trainer", {})
    resumable = RESUMABLE_CHANGES
    fitted = trainer.get("cooldown", 0.0) > 0 or trainer.get("warmup_fraction", 0.0) > 0
    fitted = fitted or trainer.get("long_budget_epochs", 0.0) > 0  # the dropout depends on the budget too
    if trainer.get("schedule", "inverse_sqrt") != "inverse_sqrt" or fitted:
        resumable = RESUMABLE_CHANGES - BUDGET
    keys = sorted(set(b) - resumable)
    before = {k: a[k] if k in a else d.get(k) for k in keys}
    return [f"{k} ({before[k]!r} in the checkpoint, {b[k]!r} now)" for k in keys if before[k] != b[k]]


def resume_path(resume: str | None, run_dir: Path, overwrite: bool) -> Path | None:
    """The checkpoint to resume from: trainer.resume (a file or a run directory), else this run
    directory's own latest checkpoint. None starts fresh."""
    if resume:
        path = Path(resume)
        path = path / "checkpoint_last.pt" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f"trainer.resume={resume}: no checkpoint at {path}")
        return path
    own = run_dir / "checkpoint_last.pt"
    if own.is_file() and not overwrite:
        return own
    return None


def clear_run(run_dir: Path) -> None:
    """What trainer.overwrite=true replaces: an earlier run's checkpoints, tokenizer and logs of numbers."""
    for path in [*run_dir.glob("checkpoint_*.pt"), run_dir / "spm.model", run_dir / "metrics.jsonl"]:
        path.unlink(missing_ok=True)
    shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)


def remove_unfinished(run_dir: Path, step: int) -> None:
    """What a killed run left beyond the checkpoint a run starts from at `step`: temporary files of
    interrupted writes, and numbered checkpoints of later steps (the run writes them again)."""
    for path in [*run_dir.glob(".*.tmp"), *(p for p in numbered(run_dir) if step_of(p) > step)]:
        path.unlink(missing_ok=True)


def check_compatible(
    path: Path, saved_config: dict, current_config: dict, explicit: bool, defaults: dict | None = None
) -> None:
    """Refuse to resume (or to train into a directory) whose run had another configuration."""
    differences = config_differences(saved_config, current_config, defaults)
    if not differences:
        return
    if explicit:
        raise ConfigError(f"cannot resume from {path}: the configuration differs: {'; '.join(differences)}")
    raise ConfigError(
        f"{path.parent} already holds another run (differs in {'; '.join(differences)}); "
        "choose another hydra.run.dir, or set trainer.overwrite=true to replace it"
    )


class GracefulStop:
    """Turns SIGTERM and SIGINT into a request the training loop honours at the next step boundary.

    A second signal while the first is pending restores the default handlers (so a third one
    kills as usual)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> GracefulStop:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            self.__exit__()
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None
