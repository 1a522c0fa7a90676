"""The training split as batches, epoch after epoch, and the state of a run that says where it
is (TrainState, saved in every resumable checkpoint)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from ..data.batching import SubwordSampler, TokenizedCorpus, collate, token_batches
from ..errors import DataError
from .distributed import World

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What a run keeps track of, saved in every resumable checkpoint."""

    step: int = 0
    epoch: int = 1
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    best_score: float = -math.inf  # validation BLEU, or minus the validation loss without BLEU
    best_step: int = 0  # the step of checkpoint_best.pt (0: none yet)
    bad_evals: int = 0
    bad_steps: int = 0  # consecutive skipped updates (non-finite loss or gradients)
    train_tokens: int = 0  # non-padding source + target tokens seen
    train_seconds: float = 0.0  # wall time of the loop, validation included
    valid_seconds: float = 0.0  # of which validation
    warmup_progress: float = 0.0  # fraction of the training budget used when warmup ended
    warmup_end: int = 0  # the step at which warmup ended (0: not yet)
    planned_epochs: float = 0.0  # the epochs the budget holds, estimated at plan.PLAN_AT of it (0: not yet)
    planned_dropout: float | None = None  # the dropout the plan set on the model (None: model.dropout)

    def epochs_done(self, epoch_size: int, unconsumed: int = 0) -> float:
        """Epochs trained, as a fraction: the full ones, plus the share of the current epoch's
        `epoch_size` batches consumed, less its last `unconsumed` ones."""
        return self.epoch - 1 + max(self.batch_in_epoch - unconsumed, 0) / max(epoch_size, 1)


class EpochBatches:
    """Batches of sentences of similar length, up to data.max_tokens padded tokens each, in an
    order that is a fixed function of (seed, epoch): the same on every rank and after a resume.
    Distributed, each rank takes its share (`rank_batches`)."""

    def __init__(self, cfg, train: TokenizedCorpus, tokenizer, world: World, device):
        self.cfg, self.train_data, self.tokenizer, self.world, self.device = cfg, train, tokenizer, world, device
        self.lengths = train.lengths()
        self.epoch_size = 1  # batches in the current epoch on this rank
        self.sampler: SubwordSampler | None = None  # with data.subword_alpha
        self._sampled: tuple[int, TokenizedCorpus | None] = (0, None)  # (epoch, its segmentation)

    def epoch_corpus(self, epoch: int) -> TokenizedCorpus:
        """The training split as one epoch sees it: the usual segmentation, or with
        data.subword_alpha > 0 one drawn from (seed, epoch), the same on every rank and on resume."""
        if self.cfg.data.subword_alpha <= 0:
            return self.train_data
        if self._sampled[0] != epoch:
            first = self.sampler is None
            self.sampler = self.sampler or SubwordSampler(self.train_data, self.tokenizer, self.cfg.data)
            self._sampled = (epoch, self.sampler.draw(np.random.default_rng([self.cfg.seed, epoch, 1])))
            if first and self.world.is_main:
                growth = self._sampled[1].lengths().sum() / self.lengths.sum() - 1
                log.info("subword sampling: epoch %d's pairs are %.1f%% longer than usual", epoch, 100 * growth)
        return self._sampled[1]

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The batches of one epoch: a fixed function of (seed, epoch), so runs are reproducible."""
        rng = np.random.default_rng([self.cfg.seed, epoch])
        corpus = self.epoch_corpus(epoch)
        lengths = self.lengths if corpus is self.train_data else corpus.lengths()
        return token_batches(lengths, self.cfg.data.max_tokens, rng)

    def rank_batches(self, epoch: int) -> list[np.ndarray]:
        """This process's share of the epoch: every world_size-th batch, from its rank on (the
        last few batches are dropped so every rank takes as many)."""
        batches = self.epoch_batches(epoch)
        if not self.world.distributed:
            return batches
        usable = len(batches) // self.world.size * self.world.size
        return batches[self.world.rank : usable : self.world.size]

    def stream(self, state: TrainState):
        """Yields batches forever, tracking the epoch and the position inside it in `state`."""
        while True:
            batches = self.rank_batches(state.epoch)
            self.epoch_size = len(batches)
            if not batches:  # (an empty epoch would loop forever)
                raise DataError(f"epoch {state.epoch} has no training batches for process {self.world.rank}")
            while state.batch_in_epoch < len(batches):
                indices = batches[state.batch_in_epoch]
                state.batch_in_epoch += 1
                yield collate(self.epoch_corpus(state.epoch), indices, self.tokenizer).to(self.device)
            state.epoch += 1
            state.batch_in_epoch = 0
