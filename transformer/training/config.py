"""What a training run is told: TrainerConfig, the `trainer:` group of configs/ (part of the typed
Config of transformer/config.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..devices import PRECISIONS
from .schedule import SCHEDULES

FREEZABLE = ("embeddings", "encoder", "decoder")  # the parts trainer.freeze may name


@dataclass
class TrainerConfig:
    device: str = "auto"  # "auto" picks cuda when present, else cpu
    precision: str = "auto"  # auto: bf16 on GPUs (else fp16) and on CPUs with bf16 matrix instructions, else fp32
    threads: int = 0  # CPU threads for torch; 0 keeps torch's default
    lr: float = 7e-4  # peak learning rate, reached at the end of warmup
    warmup_steps: int = 4000
    warmup_fraction: float = 0.0  # > 0: warmup also ends once this fraction of the budget is used, if that is sooner
    schedule: str = "inverse_sqrt"  # after warmup: inverse_sqrt (the paper), or linear/cosine: to 0 at the budget
    cooldown: float = 0.0  # fraction of the budget at its end over which the lr falls linearly to 0; 0: none
    long_budget_epochs: float = 0.0  # > 0: a budget holding at least this many epochs (estimated at 2% of it) ...
    long_budget_dropout: float = 0.3  # ... trains with this model.dropout from then on (training/plan.py)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-9
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False  # true: AdamW, each step shrinks the weights by lr * weight_decay
    label_smoothing: float = 0.1
    clip_norm: float = 0.0  # max gradient norm; 0 disables clipping
    accumulate: int = 1  # batches per optimizer step (gradient accumulation)
    max_steps: int = 100_000
    max_epochs: int = 0  # 0: no limit
    max_minutes: float = 0.0  # wall-clock budget for the training loop; 0: no limit
    max_tokens_seen: int = 0  # budget in non-padding source+target tokens, the same on every machine; 0: no limit
    patience: int = 0  # stop after this many validations without a better score; 0: never
    eval_every: int = 1000  # optimizer steps between validations (each saves a checkpoint); also one at the end, unless within a quarter of this after the last
    keep_last: int = 5  # numbered checkpoints kept (weights only, for averaging); 0 keeps none
    average_last: int = 0  # after training, also evaluate the average of the last N numbered checkpoints
    eval_bleu: bool = True  # greedy-decode the validation split and select the best checkpoint by BLEU
    attention_images: bool = True  # with eval_bleu: TensorBoard heatmaps of every head for one validation sentence
    log_every: int = 100
    resume: Optional[str] = None  # a checkpoint or run directory to continue from
    overwrite: bool = False  # start afresh in a run directory that already holds a checkpoint
    max_bad_steps: int = 5  # consecutive steps with non-finite loss or gradients before giving up
    deterministic: bool = False  # deterministic kernels (torch.use_deterministic_algorithms)
    compile: bool = False  # torch.compile the training forward pass (needs a C++ compiler on CPU)
    rdrop: float = 0.0  # R-Drop: weight of the symmetric KL between two dropout passes of each batch; 0: off
    recompute: bool = False  # activation checkpointing: recompute each layer in backward, to save memory
    members: int = 1  # models trained at once (seeds seed..seed+N-1, cores/N threads each), then ensembled
    freeze: list[str] = field(
        default_factory=list
    )  # parts not trained, of embeddings, encoder, decoder (e.g. when fine-tuning)

    def __post_init__(self) -> None:
        self.check_ranges()
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(
                f"trainer.warmup_fraction={self.warmup_fraction} must be a fraction of the budget, in [0, 1)"
            )
        if not 0.0 <= self.cooldown <= 1.0:
            raise ValueError(f"trainer.cooldown={self.cooldown} must be a fraction of the budget, between 0 and 1")
        if not 0.0 <= self.long_budget_dropout < 1.0:
            raise ValueError(f"trainer.long_budget_dropout={self.long_budget_dropout} is not in [0, 1)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"trainer.schedule={self.schedule!r} is not one of {SCHEDULES}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"trainer.precision={self.precision!r} is not one of {PRECISIONS}")
        unknown = [part for part in self.freeze if part not in FREEZABLE]
        if unknown or len(set(self.freeze)) != len(self.freeze):
            raise ValueError(f"trainer.freeze={list(self.freeze)} must name each of {FREEZABLE} at most once")
        if self.average_last > self.keep_last:
            raise ValueError(
                f"trainer.average_last={self.average_last} needs trainer.keep_last >= it, not {self.keep_last}"
            )

    def check_ranges(self) -> None:
        """Counts of at least 1, or 0 where 0 means none, off or no limit; finite rates and weights."""
        for key in ("warmup_steps", "accumulate", "max_steps", "eval_every", "log_every", "max_bad_steps", "members"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key}={getattr(self, key)} must be >= 1")
        counts = ("threads", "max_epochs", "max_minutes", "max_tokens_seen", "patience", "keep_last", "average_last")
        for key in (*counts, "long_budget_epochs"):
            if not getattr(self, key) >= 0:  # also refuses NaN
                raise ValueError(f"trainer.{key}={getattr(self, key)} must be >= 0")
        for key in ("weight_decay", "clip_norm", "rdrop"):
            if not 0 <= getattr(self, key) < math.inf:
                raise ValueError(f"trainer.{key}={getattr(self, key)} must be >= 0 and finite")
        for key in ("lr", "eps"):
            if not 0 < getattr(self, key) < math.inf:
                raise ValueError(f"trainer.{key}={getattr(self, key)} must be > 0 and finite")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"trainer.label_smoothing={self.label_smoothing} is not in [0, 1)")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"trainer.betas={list(self.betas)} must be two numbers in [0, 1)")


DISTILL_SELECTIONS = ("all", "best")  # distill.select


@dataclass
class DistillConfig:
    """distill.py's stages (training/distill.py): the teacher translates the training sources with
    the run's decode settings, the pairs are filtered, and the student trains on them."""

    n_best: int = 1  # teacher translations per source (beam search's n best; at most decode.beam_size)
    select: str = "all"  # with n_best > 1: all of them, or the best by sentence chrF against the reference
    max_length_ratio: float = 2.5  # drop pairs whose longer side has more than this many times the other's pieces
    drop_worst: float = 0.05  # drop this fraction of the pairs with the lowest teacher log-probability per piece
    references: bool = False  # also train on the original pairs (the references), beside the distilled ones
    chunk_lines: int = 2000  # sources translated between two saves of the translate stage's progress
    shortlist: bool = True  # build the student's shortlist (decode.shortlist=true, the export's vmap)
    overwrite: bool = False  # redo a stage whose saved output came from other inputs (else refused)

    def __post_init__(self) -> None:
        if self.n_best < 1 or self.chunk_lines < 1:
            raise ValueError(f"distill.n_best={self.n_best} and distill.chunk_lines={self.chunk_lines} must be >= 1")
        if self.select not in DISTILL_SELECTIONS:
            raise ValueError(f"distill.select={self.select!r} is not one of {DISTILL_SELECTIONS}")
        if not 1.0 <= self.max_length_ratio < math.inf:
            raise ValueError(f"distill.max_length_ratio={self.max_length_ratio} must be >= 1 and finite")
        if not 0.0 <= self.drop_worst < 1.0:
            raise ValueError(f"distill.drop_worst={self.drop_worst} must be a fraction in [0, 1)")
