"""Dropout whose random mask is cheap to draw on a CPU (replaces nn.Dropout's forward).

On a CPU, torch's dropout draws every element's Bernoulli sample on its own: one call of the
Mersenne Twister and a double-precision comparison per element, on one thread (torch uses MKL's
vectorized generator for this on Intel CPUs only).

`FastDropout` here draws 64-bit random words instead, four elements to a word: each element keeps
its value when its 16-bit quarter of the word is at or above a threshold. The drop probability
is therefore rounded to a multiple of 2^-16 (0.3 becomes 0.300003), and kept values are scaled
by the inverse of the exact keep probability, so the expectation is unchanged. The mask is
saved for the backward pass as one byte per element (torch saves a float per element).
docs/PERFORMANCE.md has the measured effect.

Masks come from torch's default generator, so `torch.manual_seed` makes them repeatable and
activation recomputation (torch.utils.checkpoint) replays them. On other devices `FastDropout`
calls torch's fused dropout kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LEVELS = 1 << 16  # the mask compares 16-bit random numbers


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> tuple[Tensor, float]:
    """(bool mask of `shape`, True where an element is kept; its exact keep probability)."""
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(1 << 63), None)
    halves = words.view(torch.int16)[:n].view(shape)  # uniform on [-2^15, 2^15)
    dropped = round(p * LEVELS)
    return halves >= dropped - LEVELS // 2, (LEVELS - dropped) / LEVELS


class MaskedScale(torch.autograd.Function):
    """x * mask * scale, with the bool mask (not a float copy) saved for the backward pass."""

    @staticmethod
    def forward(ctx, x: Tensor, mask: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x.mul(mask).mul_(scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return grad.mul(mask).mul_(ctx.scale), None, None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """F.dropout(x, p, training), with the cheaper mask on CPU tensors."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, training)
    mask, keep = keep_mask(x.shape, p, x.device)
    if keep == 1.0:  # p below 2^-17 rounds to no dropout
        return x
    return MaskedScale.apply(x, mask, 1.0 / keep)


class FastDropout(nn.Dropout):
    """nn.Dropout (its checks, repr and type) with the cheaper CPU mask of this module."""

    def __init__(self, p: float = 0.5):
        super().__init__(p)

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)
