"""A run's checkpoint files, and what resuming needs in them.

    checkpoint_last.pt     resumable: the weights, the optimizer, the gradient scaler, the run's
                           state (TrainState), every random generator, the log line's window and,
                           when they differ from the current ones, the best weights
    checkpoint_best.pt     the weights of the best validation so far
    checkpoint_<step>.pt   the weights at each validation, the newest trainer.keep_last of them

The file format (one self-contained file) is ../checkpoint.py; random-generator states are resume.py's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from pathlib import Path

from .. import checkpoint
from ..model import Transformer
from ..monitoring import Throughput
from .batches import TrainState
from .resume import rng_states, set_rng_states

log = logging.getLogger(__name__)


class CheckpointKeeper:
    """Writes and reads one run's checkpoints, and keeps the best weights in memory (on the CPU)
    so that checkpoint_last.pt can carry them. In a distributed run rank 0 alone writes."""

    def __init__(self, cfg, run_dir: Path, model: Transformer, tokenizer, optimizer, scaler, window: Throughput):
        self.cfg, self.run_dir, self.model, self.tokenizer = cfg, Path(run_dir), model, tokenizer
        self.optimizer, self.scaler, self.window = optimizer, scaler, window
        self.best_model: dict | None = None  # the weights of checkpoint_best.pt

    def save(self, name: str, state: TrainState, with_optimizer: bool = True) -> Path:
        """A weights-only checkpoint, or with_optimizer a resumable one: everything `restore` needs,
        the best checkpoint's weights among it when they are not the current ones."""
        path = self.run_dir / name
        extra = {}
        if with_optimizer:
            extra = {
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "train_state": vars(state).copy(),
                "rng": rng_states(),
                "log_window": self.window.state(),
            }
            if state.best_step != state.step and self.best_model is not None:
                extra["best_model"] = self.best_model
        checkpoint.save(path, self.model, self.tokenizer, train_config=to_plain(self.cfg), step=state.step, **extra)
        return path

    def restore(self, payload: dict) -> TrainState:
        """Continue exactly where a checkpoint written by `save` left off: weights, optimizer,
        scaler, every random generator, the log line's window and the best checkpoint's weights.
        Returns the run's state: step, epoch, position in the epoch's batches, ..."""
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.scaler.load_state_dict(payload["scaler"])
        state = TrainState(**payload["train_state"])
        set_rng_states(payload["rng"])
        if "log_window" in payload:
            self.window.restore(payload["log_window"], next(self.model.parameters()).device)
        if state.best_step == state.step:
            self.best_model = cpu_copy(self.model.state_dict())
        elif "best_model" in payload:
            self.best_model = payload["best_model"]
        return state

    def after_validation(self, state: TrainState, value: float) -> bool:
        """Track the best score (and the validations since) in `state` and save checkpoints;
        returns whether `value` is the best so far.

        The files are written so that a crash between any two leaves a consistent run: the
        numbered checkpoint first (a resumed run writes it again), then checkpoint_last.pt, which
        commits the validation and holds what checkpoint_best.pt is made of, then the best."""
        improved = value > state.best_score
        if improved:
            state.best_score, state.best_step, state.bad_evals = value, state.step, 0
            self.best_model = cpu_copy(self.model.state_dict())
        else:
            state.bad_evals += 1
        self.save_numbered(state)
        self.save("checkpoint_last.pt", state)
        if improved:
            self.save("checkpoint_best.pt", state, with_optimizer=False)
        return improved

    def save_numbered(self, state: TrainState) -> None:
        """checkpoint_<step>.pt, keeping the newest trainer.keep_last of them."""
        if self.cfg.trainer.keep_last <= 0:
            return
        self.save(f"checkpoint_{state.step}.pt", state, with_optimizer=False)
        checkpoint.keep_newest(self.run_dir, self.cfg.trainer.keep_last)

    def restore_best(self, state: TrainState) -> None:
        """Make checkpoint_best.pt hold the best weights that checkpoint_last.pt records (a crash
        between the two, or a run resumed into a new directory, leaves it stale or missing)."""
        path = self.run_dir / "checkpoint_best.pt"
        if not state.best_step or (path.is_file() and checkpoint.load(path)["step"] == state.best_step):
            return
        if self.best_model is None:  # a checkpoint from before best_model was saved with it
            log.warning("%s is missing or stale and the resumed checkpoint lacks its weights; the next validation writes it", path)  # fmt: skip
            state.best_score, state.best_step = -math.inf, 0
            return
        checkpoint.save(path, self.model, self.tokenizer, to_plain(self.cfg), state.best_step, weights=self.best_model)
        log.info("wrote %s (step %d) from the resumed checkpoint", path, state.best_step)


def cpu_copy(state_dict: dict) -> dict:
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state_dict.items()}


def to_plain(cfg) -> dict:
    """A dataclass config as nested plain dicts/lists (safe for weights_only loading)."""
    return asdict(cfg)
