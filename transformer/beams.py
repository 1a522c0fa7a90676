"""The tensor operations of one beam-search step, apart from the search itself (decoding.py):
choosing each sentence's best extensions without writing out every score, and placing the
surviving beams so that as few key/value caches as possible are copied."""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def best_extensions(scores: Tensor, lprobs: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The `count` best one-token extensions of each sentence's beams: scores (sentences, width)
    and lprobs (sentences * width, vocab) -> their scores and indices (beam * vocab + token),
    each (sentences, count), sorted best first.

    The same as the top `count` of scores + lprobs over each sentence's width * vocab entries,
    without writing out that sum: the rows are cut into chunks, and the best `count` entries lie
    in the `count` chunks with the highest maxima (a chunk holding one of them has a maximum at
    least as high, and at most count - 1 other chunks can have a higher one). So one pass finds
    the chunk maxima and only those chunks are read again."""
    n, width = scores.shape
    vocab = lprobs.size(1)
    chunk = chunk_size(vocab)
    if chunk is None or width * vocab <= 4 * count * chunk:  # no chunk size fits, or little to skip
        return (scores.view(-1, 1) + lprobs).view(n, -1).topk(count, dim=1)
    per_row = vocab // chunk
    chunks = lprobs.view(n * width, per_row, chunk)
    maxima = (chunks.amax(-1) + scores.view(-1, 1)).view(n, width * per_row)
    best = maxima.topk(count, dim=1).indices  # (n, count): chunk numbers within each sentence
    beam = best // per_row
    rows = torch.arange(n, device=lprobs.device)[:, None] * width + beam
    values = chunks[rows, best % per_row] + scores.gather(1, beam)[..., None]  # (n, count, chunk)
    top, where = values.view(n, -1).topk(count, dim=1)
    return top, best.gather(1, where // chunk) * chunk + where % chunk


@functools.cache
def chunk_size(vocab: int) -> int | None:
    """The largest divisor of the vocabulary size from 16 to 256 (None if there is none): the
    chunk `best_extensions` cuts rows into. Cached, since every beam-search step asks."""
    return next((c for c in range(256, 15, -1) if vocab % c == 0), None)


def stay_in_place(parents: Tensor) -> Tensor:
    """An order for each sentence's k surviving beams that puts a survivor in its parent's slot
    where it can: (sentences, k) parent slots -> (sentences, k) indices to gather survivors by.

    Beam search depends on the set of beams, not their order, and a beam that stays in its
    parent's slot needs no copy of its key/value cache (see GrowingCache.reorder). The first
    survivor of each parent takes the parent's slot; the others fill the free slots in order.
    """
    n, k = parents.shape
    slots = torch.arange(k, device=parents.device)
    earlier = torch.ones(k, k, dtype=torch.bool, device=parents.device).tril(-1)  # [j, i]: i before j
    first = ~((parents[:, :, None] == parents[:, None, :]) & earlier).any(-1)  # first survivor of its parent
    taken = (parents[:, :, None] == slots).any(1)  # slot s is some survivor's parent
    free = torch.sort(taken.to(torch.int8), dim=1, stable=True).indices  # the free slots first, ascending
    rank = ((~first).long().cumsum(1) - 1).clamp(min=0)  # position among the survivors that move
    slot = torch.where(first, parents, free.gather(1, rank))
    return torch.empty_like(slot).scatter_(1, slot, slots.expand(n, k))
