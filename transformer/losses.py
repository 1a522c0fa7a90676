"""The training objective and schedule: the paper's learning-rate schedule, label-smoothed
cross-entropy (a readable reference and the fused version training uses) and R-Drop's
symmetric KL regularizer."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor


def inverse_sqrt_lr(step: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then decay with 1/sqrt(step).

    With peak = d_model^-0.5 * warmup^-0.5 this is the paper's
    lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).
    """
    step = max(step, 1)
    return peak * min(step / warmup, math.sqrt(warmup / step))


SCHEDULES = ("inverse_sqrt", "linear", "cosine")


def scheduled_lr(
    schedule: str, step: int, peak: float, warmup: int, progress: float, warmup_progress: float, cooldown: float = 0.0
) -> float:
    """The learning rate of `schedule` at optimizer step `step` (1-based), times the cooldown:
    over the last `cooldown` fraction of the budget it falls linearly to 0 (0: no cooldown).

    inverse_sqrt is the paper's schedule (`inverse_sqrt_lr`); it ignores the budget. linear and
    cosine warm up the same way, then decay from `peak` to 0 over the rest of the training
    budget: `progress` is the fraction of the budget used so far and `warmup_progress` the
    fraction used when warmup ended. A run stopped by its budget (steps, epochs or minutes)
    thus ends at a learning rate of 0, which anneals its last weights the way checkpoint
    averaging does, but without the lag of averaging older checkpoints.
    """
    scale = min(1.0, (1.0 - progress) / cooldown) if cooldown > 0 else 1.0
    if schedule == "inverse_sqrt":
        return scale * inverse_sqrt_lr(step, peak, warmup)
    if step < warmup:
        return scale * peak * max(step, 1) / warmup
    decay = (progress - warmup_progress) / max(1.0 - warmup_progress, 1e-9)
    decay = min(max(decay, 0.0), 1.0)
    if schedule == "linear":
        return scale * peak * (1.0 - decay)
    if schedule == "cosine":
        return scale * peak * 0.5 * (1.0 + math.cos(math.pi * decay))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; expected one of {SCHEDULES}")


def label_smoothed_loss(logits: Tensor, target: Tensor, pad_id: int, smoothing: float) -> tuple[Tensor, Tensor]:
    """Summed over non-padding tokens: (label-smoothed loss, plain negative log-likelihood).

    The smoothed target puts 1 - smoothing on the reference token and spreads `smoothing`
    uniformly over the vocabulary.
    """
    lprobs = F.log_softmax(logits.float(), dim=-1)  # (batch, len, vocab)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    uniform = -lprobs.mean(-1)
    keep = target != pad_id
    loss = ((1.0 - smoothing) * nll + smoothing * uniform).masked_fill(~keep, 0.0).sum()
    return loss, nll.masked_fill(~keep, 0.0).sum()


def smoothed_cross_entropy(logits: Tensor, target: Tensor, pad_id: int, smoothing: float) -> Tensor:
    """The label-smoothed loss of `label_smoothed_loss`, summed, computed by torch's fused
    cross-entropy: no (tokens, vocab) temporaries beyond the log-probabilities. Used in training."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), target.flatten(), ignore_index=pad_id, label_smoothing=smoothing, reduction="sum"
    )


def symmetric_kl(logits_a: Tensor, logits_b: Tensor, keep: Tensor) -> Tensor:
    """R-Drop's regularizer (Liang et al. 2021): (KL(p_a || p_b) + KL(p_b || p_a)) / 2, summed over
    the target positions where `keep` is True. logits: (batch, len, vocab); keep: (batch, len)."""
    a, b = F.log_softmax(logits_a.float(), dim=-1), F.log_softmax(logits_b.float(), dim=-1)
    kl = (a.exp() * (a - b) + b.exp() * (b - a)).sum(-1) / 2
    return kl.masked_fill(~keep, 0.0).sum()
