"""Encoding a batch in groups of similar length (replaces Transformer.encode at inference on CPU).

A batch of mixed lengths is padded to its longest sentence, and the encoder's products pay for
the padding. At inference on a CPU (no gradients, no weights asked for), `encode_grouped` encodes
groups of sentences of similar length, each padded only to its own longest, and puts the results
back in place; memory past a group's longest sentence is zero, and the mask hides it. On GPUs,
where small products cost their launch more than their arithmetic, the batch stays whole.
docs/PERFORMANCE.md has the measured effect.
"""

from __future__ import annotations

import torch
from torch import Tensor


def length_groups(real: Tensor, min_tokens: int = 256, ratio: float = 0.8) -> list[tuple[Tensor, int]]:
    """Split a batch into groups of sentences of similar length: real (batch, len), True at real
    tokens -> [(rows, length)], each group's rows and the length that holds all of their tokens.

    Going from the longest sentence down, a group ends where the next sentence is shorter than
    `ratio` times the group's longest, once the group holds `min_tokens` padded tokens (smaller
    groups would pay more in per-product overhead than they save)."""
    positions = torch.arange(1, real.size(1) + 1, device=real.device)
    lengths = (real * positions).amax(1)  # up to the last real token, wherever the padding is
    order = lengths.argsort(descending=True, stable=True).tolist()
    sizes = lengths.tolist()
    groups, start = [], 0
    for i in range(1, len(order) + 1):
        longest = sizes[order[start]]
        if i == len(order) or (sizes[order[i]] < ratio * longest and (i - start) * longest >= min_tokens):
            groups.append((torch.tensor(order[start:i], device=real.device), max(longest, 1)))
            start = i
    return groups


def encode_grouped(encode, src: Tensor, src_mask: Tensor) -> tuple[Tensor, list]:
    """encode(src, src_mask) (the reference Transformer.encode, bound to a model) computed group by
    group (see `length_groups`); the weights returned are the last group's."""
    groups = length_groups(src_mask.flatten(1))
    if len(groups) == 1 and groups[0][1] == src.size(1):
        return encode(src, src_mask)
    memory, weights = None, []
    for rows, length in groups:
        out, weights = encode(src[rows, :length], src_mask[rows, ..., :length])
        if memory is None:
            memory = out.new_zeros(src.size(0), src.size(1), out.size(-1))
        memory[rows, :length] = out
    return memory, weights
