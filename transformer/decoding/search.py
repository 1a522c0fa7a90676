"""Search on one padded batch: what every strategy shares (the hypotheses, dropping finished
sentences from the batch) and `generate`, which extends each sentence by one
chosen token per step: greedy search (`argmax`) and sampling (`sampler`). Beam search is beam.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..model import padding_mask
from .processors import Columns, log_probs, max_lengths, source_lengths

if TYPE_CHECKING:
    from .config import DecodeConfig


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS and EOS
    score: float  # log-probability divided by the length penalty (the ranking score)
    log_prob: float


def select(memory, rows: Tensor):
    """The encoder output of the batch rows `rows` (a tensor, or a list for ensembles)."""
    if isinstance(memory, Tensor):
        return memory.index_select(0, rows)
    return [select(m, rows) for m in memory]


def worth_pruning(n_done: int, n_rows: int) -> bool:
    """Whether to drop finished sentences from the batch now. Dropping copies every cache, so it
    waits until a quarter of the rows are finished: at most a few dozen copies per batch."""
    return n_done > 0 and 4 * n_done >= n_rows


def strip_special(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


@torch.no_grad()
def generate(
    model, src: Tensor, bos_id: int, eos_id: int, cfg: DecodeConfig, choose: Callable, prefix: Tensor | None = None
) -> list[Hypothesis]:
    """Extend each sentence by `choose(log_probs)` until EOS or its maximum length, starting with
    its target prefix (batch, prefix_len; -1 after its end) when one is given.

    Finished sentences leave the batch (see `worth_pruning`), so later steps only pay for the
    sentences still being translated. `choose` picks columns of the logits: a shortlisted model's
    are its candidates (processors.Columns), mapped back to token ids here."""
    src_mask = padding_mask(src, model.cfg.pad_id)
    memory, _ = model.encode(src, src_mask)
    max_len = max_lengths(source_lengths(src_mask), cfg, model.cfg.max_positions - 1, prefix)
    shortest = int(max_len.min())  # no row is out of room before this step (a host copy)
    columns, eos_column, pad_column, prefix = Columns.for_search(model, eos_id, model.cfg.pad_id, prefix)
    tokens = torch.full((src.size(0), 1), bos_id, dtype=torch.long, device=src.device)
    log_prob = torch.zeros(src.size(0), device=src.device)
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    sentence = torch.arange(src.size(0), device=src.device)  # the input sentence of each row
    out: list[Hypothesis] = [Hypothesis([], 0.0, 0.0)] * src.size(0)
    state = model.new_state()
    for step in range(int(max_len.max())):
        logits, _ = model.decode(tokens[:, -1:], memory, src_mask, state)
        forcing = step + 1 >= shortest
        lprobs = log_probs(logits[:, -1], step, max_len, eos_column, pad_column, cfg.min_len, prefix, forcing=forcing)
        chosen = choose(lprobs)
        next_token = torch.where(done, model.cfg.pad_id, columns.tokens(chosen))
        log_prob += torch.where(done, 0.0, lprobs.gather(1, chosen[:, None]).squeeze(1))
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        done |= next_token == eos_id
        n_done = int(done.sum())
        if n_done == done.numel() or worth_pruning(n_done, done.numel()):
            ended = done.nonzero().flatten()  # copied to the host together, not row by row
            for i, lp, ids in zip(sentence[ended].tolist(), log_prob[ended].tolist(), tokens[ended, 1:].tolist()):
                out[i] = Hypothesis(strip_special(ids, eos_id), lp, lp)
            if n_done == done.numel():
                break
            rows = (~done).nonzero().flatten()
            tokens, log_prob, max_len, sentence = tokens[rows], log_prob[rows], max_len[rows], sentence[rows]
            shortest = int(max_len.min())
            memory, src_mask, done = select(memory, rows), src_mask[rows], done[rows]
            prefix = None if prefix is None else prefix[rows]
            state.reorder(rows)
    return out  # the last step ends every sentence: max_len forces EOS


def argmax(lprobs: Tensor) -> Tensor:
    """The greedy choice: the most probable token of each row (the first of equals, as argmax
    gives it; on CPU torch's max over a dimension finds it faster than argmax, see
    docs/PERFORMANCE.md)."""
    return lprobs.max(-1).indices


def greedy(model, src: Tensor, bos_id: int, eos_id: int, cfg: DecodeConfig, prefix=None) -> list[list[int]]:
    """The most probable next token at every step. src: (batch, src_len) -> token ids, no BOS/EOS."""
    return [h.tokens for h in generate(model, src, bos_id, eos_id, cfg, argmax, prefix)]


def sampler(cfg: DecodeConfig, generator: torch.Generator) -> Callable[[Tensor], Tensor]:
    """Draw the next token from the temperature-scaled distribution, cut to top-k and top-p."""

    def choose(lprobs: Tensor) -> Tensor:
        logits = lprobs / cfg.temperature
        if cfg.top_k:
            kth = logits.topk(min(cfg.top_k, logits.size(-1)), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if cfg.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            mass_before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)
            drop = (mass_before >= cfg.top_p).scatter(-1, order, mass_before >= cfg.top_p)
            logits = logits.masked_fill(drop, -math.inf)
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)

    return choose
