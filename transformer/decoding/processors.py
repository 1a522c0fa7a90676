"""The step every search shares: the decoder's logits -> the log-probabilities a search chooses
from, and the rules that end a sentence.

Every search (greedy, sampling, beam, constrained beam) and the step-level engine call
`log_probs` once per step, so the rules below hold the same way everywhere:

- padding is never generated (an imported Marian model starts from it);
- EOS is refused before decode.min_len tokens and, with constraints, before every phrase is in
  (`may_not_end`), unless the row is out of room;
- while a target prefix lasts, its token is the only choice, with its own log-probability;
- a row at its length limit (`max_lengths`) can only end: EOS is its only choice (the limit
  counts the EOS, so it wins over a prefix that would go on).

Sampling's temperature, top-k and top-p reshape the distribution a token is drawn from, not the
score it gets: they are the sampler's (search.py). `sentence_done` is the one stopping rule of
every beam search.

The logits have a column per vocabulary token, or, for a model narrowed to a lexical shortlist's
candidates (shortlist.py), a column per candidate: `Columns` maps between token ids and columns,
so a search runs its softmax, arg-max and top-k over the candidates alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from .config import DecodeConfig
    from .search import Hypothesis


class Columns:
    """Which token each column of a model's logits is: every vocabulary id in order (`ids` None),
    or the sorted ids (u,) of a shortlisted model's candidates (the model's `columns`)."""

    def __init__(self, ids: Tensor | None):
        self.ids = ids

    @classmethod
    def of(cls, model) -> Columns:
        return cls(getattr(model, "columns", None))

    @classmethod
    def for_search(cls, model, eos_id: int, pad_id: int, prefix: Tensor | None) -> tuple:
        """What a search hands `log_probs`: the model's columns, EOS's and padding's columns and
        the prefix (batch, prefix_len; -1 after its end) as columns."""
        columns = cls.of(model)
        return columns, columns.column(eos_id), columns.column(pad_id), columns.columns(prefix)

    def count(self, vocab_size: int) -> int:
        """How many columns the logits have."""
        return vocab_size if self.ids is None else len(self.ids)

    def column(self, token: int) -> int | None:
        """The column of one token id; None when it has none."""
        if self.ids is None:
            return token
        at = int(torch.searchsorted(self.ids, token))
        return at if at < len(self.ids) and int(self.ids[at]) == token else None

    def columns(self, tokens: Tensor | None) -> Tensor | None:
        """Token ids (any shape; -1 for none, as in a padded prefix) -> their columns, -1 kept.
        Every id given must have a column (a prefix's and constraints' ids are candidates)."""
        if self.ids is None or tokens is None:
            return tokens
        at = torch.searchsorted(self.ids, tokens.clamp(min=0)).clamp(max=len(self.ids) - 1)
        if bool(((self.ids[at] != tokens) & (tokens >= 0)).any()):
            raise ValueError("a forced token is not among the model's candidate columns")
        return torch.where(tokens >= 0, at, tokens)

    def tokens(self, columns: Tensor) -> Tensor:
        """Columns (any shape) -> the token ids they are."""
        return columns if self.ids is None else self.ids[columns]


def max_lengths(src_lens: Tensor, cfg: DecodeConfig, limit: int, prefix: Tensor | None = None, extra: Tensor | None = None) -> Tensor:  # fmt: skip
    """(batch,) the most tokens each sentence may generate, EOS included: max_len_a * source
    tokens + max_len_b; with a target prefix (batch, prefix_len; -1 after its end) at least the
    prefix and max_len_b tokens after it; plus `extra` (batch,) tokens (constraints' length);
    never more than `limit`, the model's positions."""
    max_len = (src_lens * cfg.max_len_a + cfg.max_len_b).long()
    if prefix is not None:
        max_len = torch.maximum(max_len, prefix_lengths(prefix) + cfg.max_len_b)
    if extra is not None:
        max_len = max_len + extra
    return max_len.clamp(min=1, max=limit)


def source_lengths(src_mask: Tensor) -> Tensor:
    """(batch,) real source tokens per sentence, from a padding mask (batch, 1, 1, src_len)."""
    return src_mask.flatten(1).sum(-1)


def prefix_lengths(prefix: Tensor) -> Tensor:
    """(rows,) the number of prefix tokens of each row of prefix (rows, prefix_len), padded with -1."""
    return (prefix >= 0).sum(-1)


def log_probs(
    logits: Tensor,
    step: int | Tensor,
    max_len: Tensor,
    eos_id: int,
    pad_id: int | None,
    min_len: int = 0,
    prefix: Tensor | None = None,
    may_not_end: Tensor | None = None,
    forcing: bool | None = None,
) -> Tensor:
    """Log-probabilities (rows, vocab) of each row's next token under the rules of the module
    docstring. logits (rows, vocab); step: tokens generated so far, one for all rows or (rows,)
    each its own; max_len (rows,); prefix (rows, prefix_len) or None; may_not_end (rows,) or None.
    eos_id, pad_id and the prefix's ids are columns of `logits` (`Columns`; pad_id None: no column).
    `forcing` says whether any row is at its limit when the caller knows it without waiting for
    the device (None: find out)."""
    lprobs = F.log_softmax(logits.float(), dim=-1)
    if pad_id is not None:
        lprobs[:, pad_id] = -math.inf
    out_of_room = step + 1 >= max_len  # (rows,)
    early = step < min_len
    if may_not_end is not None or not isinstance(early, bool) or early:
        refuse = early if may_not_end is None else may_not_end | early
        lprobs[:, eos_id] = torch.where(refuse & ~out_of_room, -math.inf, lprobs[:, eos_id])
    ending = lprobs[:, eos_id].clone() if forcing is None or forcing else None  # before a prefix takes it away
    if prefix is not None:
        lprobs = force_prefix(lprobs, prefix, step)
    if ending is not None:
        lprobs = only_eos(lprobs, out_of_room, eos_id, ending)
    return lprobs


def force_prefix(lprobs: Tensor, prefix: Tensor, step: int | Tensor) -> Tensor:
    """Log-probabilities (rows, vocab) that leave each row whose target prefix (rows, prefix_len;
    -1 where it has ended) has a token at `step` only that token, with its log-probability. Other
    rows are unchanged."""
    if isinstance(step, int):
        if step >= prefix.size(1):
            return lprobs
        token = prefix[:, step : step + 1]  # (rows, 1)
    else:  # each row at its own step
        within = step < prefix.size(1)
        token = prefix.gather(1, step.clamp(max=prefix.size(1) - 1)[:, None]).masked_fill(~within[:, None], -1)
    at = token.clamp(min=0)
    forced = torch.full_like(lprobs, -math.inf).scatter(1, at, lprobs.gather(1, at))
    return torch.where(token >= 0, forced, lprobs)


def only_eos(lprobs: Tensor, rows: Tensor, eos_id: int, ending: Tensor) -> Tensor:
    """lprobs with the `rows` (a boolean (rows,) mask) left only EOS, at its log-probability
    `ending` (rows,) (a row's limit ends it even where a prefix would go on)."""
    if not bool(rows.any()):
        return lprobs
    lprobs[rows] = -math.inf
    lprobs[:, eos_id] = torch.where(rows, ending, lprobs[:, eos_id])
    return lprobs


def length_penalty(length: Tensor | int, alpha: float):
    """GNMT (Wu et al., 2016): lp(Y) = ((5 + |Y|) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


def sentence_done(finished: list[Hypothesis], best_live: float, max_len: int, step: int, n_best: int, alpha: float) -> bool:  # fmt: skip
    """Whether a beam-searched sentence is done: it has reached its length limit, or it has n_best
    finished hypotheses and no live beam (the best of them has log-probability best_live; -inf
    when none is left) can beat the n_best-th best.

    Log-probabilities only fall as a hypothesis grows, so a live beam's best reachable score is
    its log-probability divided by the largest length penalty it can still get.
    """
    if step + 1 >= max_len or best_live == -math.inf:
        return True
    if len(finished) < n_best:
        return False
    nth_best = sorted(h.score for h in finished)[-n_best]
    return best_live / length_penalty(max_len, alpha) <= nth_best
