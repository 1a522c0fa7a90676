"""The learning rate at each optimizer step: the paper's warmup and inverse square root decay, or a
warmup and a decay to zero at the end of the training budget, with an optional cooldown."""

from __future__ import annotations

import math

SCHEDULES = ("inverse_sqrt", "linear", "cosine")


def inverse_sqrt_lr(step: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then decay with 1/sqrt(step).

    With peak = d_model^-0.5 * warmup^-0.5 this is the paper's
    lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).
    """
    step = max(step, 1)
    return peak * min(step / warmup, math.sqrt(warmup / step))


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
