"""Other implementations of the decoding interface (transformer/decoding/__init__.py).

`Uncached` recomputes the whole target prefix at every step (no key/value cache): the reference
that cached decoding is tested and benchmarked against. `Ensemble` averages the next-token
probabilities of several models that share a vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model import DecoderState, Transformer


@dataclass
class PrefixState:
    tokens: Tensor | None = None  # (batch, tokens so far)

    def reorder(self, index: Tensor, sources: Tensor | None = None) -> None:
        self.tokens = self.tokens.index_select(0, index)

    def reorder_targets(self, index: Tensor) -> None:
        self.reorder(index)


class Uncached:
    """A Transformer decoded by full recomputation of the prefix at every step."""

    def __init__(self, model: Transformer):
        self.model, self.cfg = model, model.cfg

    def encode(self, src: Tensor, src_mask: Tensor):
        return self.model.encode(src, src_mask)

    def new_state(self) -> PrefixState:
        return PrefixState()

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor, state: PrefixState):
        state.tokens = tgt if state.tokens is None else torch.cat([state.tokens, tgt], dim=1)
        logits, weights = self.model.decode(state.tokens, memory, src_mask)
        return logits[:, -tgt.size(1) :], weights


@dataclass
class EnsembleState:
    states: list[DecoderState] = field(default_factory=list)

    def reorder(self, index: Tensor, sources: Tensor | None = None) -> None:
        for state in self.states:
            state.reorder(index, sources)

    def reorder_targets(self, index: Tensor) -> None:
        for state in self.states:
            state.reorder_targets(index)


class Ensemble:
    """Several models as one: the next-token distribution is the mean of theirs."""

    def __init__(self, models: list[Transformer]):
        first = models[0].cfg
        for model in models[1:]:
            vocabularies = (model.cfg.vocab_size, model.cfg.src_vocab_size, model.cfg.pad_id)
            if vocabularies != (first.vocab_size, first.src_vocab_size, first.pad_id):
                raise ValueError("ensembled models must share one vocabulary")
        self.models = models
        self.cfg = dataclasses.replace(first, max_positions=min(m.cfg.max_positions for m in models))

    @property
    def columns(self):
        """The token id of each logits column (processors.Columns): its members' (one shortlist's
        candidates for all of them), or None for the whole vocabulary."""
        return getattr(self.models[0], "columns", None)

    def eval(self) -> Ensemble:
        for model in self.models:
            model.eval()
        return self

    def encode(self, src: Tensor, src_mask: Tensor):
        return [model.encode(src, src_mask)[0] for model in self.models], None

    def new_state(self) -> EnsembleState:
        return EnsembleState([model.new_state() for model in self.models])

    def decode(self, tgt: Tensor, memory: list[Tensor], src_mask: Tensor, state: EnsembleState):
        lprobs = [
            F.log_softmax(model.decode(tgt, mem, src_mask, s)[0].float(), dim=-1)
            for model, mem, s in zip(self.models, memory, state.states)
        ]
        return torch.logsumexp(torch.stack(lprobs), dim=0) - math.log(len(lprobs)), None
