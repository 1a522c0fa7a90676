"""The learning rate at each optimizer step: the paper's warmup and inverse square root decay, or a
warmup and a decay to zero at the end of the training budget, with an optional cooldown. Warmup
may also end at a fraction of the budget, so that the schedule fits the steps a machine takes."""

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


def warmup_ramp(step: int, warmup_steps: int, progress: float, warmup_fraction: float = 0.0) -> float:
    """How far warmup has come, from 0 to 1: the share of `warmup_steps` taken, or with
    `warmup_fraction` > 0 the share of that fraction of the budget used, whichever is further.
    A machine too slow to take `warmup_steps` steps early in its budget thus still ends warmup
    at that fraction, and has the rest of the budget to decay."""
    ramp = step / warmup_steps
    if warmup_fraction > 0:
        ramp = max(ramp, progress / warmup_fraction)
    return min(ramp, 1.0)


def scheduled_lr(
    schedule: str,
    step: int,
    peak: float,
    warmup: int,
    progress: float,
    warmup_progress: float,
    cooldown: float = 0.0,
    ramp: float | None = None,
) -> float:
    """The learning rate of `schedule` at optimizer step `step` (1-based), times the cooldown:
    over the last `cooldown` fraction of the budget it falls linearly to 0 (0: no cooldown).

    Warmup rises linearly to `peak` over the first `warmup` steps (or as `ramp` says, from
    `warmup_ramp`, when a fraction of the budget may end it sooner; `warmup` is then the step at
    which it ended, once it has). After warmup, inverse_sqrt is the paper's schedule
    (`inverse_sqrt_lr`); it ignores the budget. linear and cosine decay from `peak` to 0 over the
    rest of the training budget: `progress` is the fraction of the budget used so far and
    `warmup_progress` the fraction used when warmup ended. A run stopped by its budget (steps,
    epochs, tokens or minutes) thus ends at a learning rate of 0, which anneals its last weights
    the way checkpoint averaging does, but without the lag of averaging older checkpoints.
    """
    scale = min(1.0, (1.0 - progress) / cooldown) if cooldown > 0 else 1.0
    if step < warmup:
        return scale * peak * (max(step, 1) / warmup if ramp is None else ramp)
    if schedule == "inverse_sqrt":
        return scale * inverse_sqrt_lr(step, peak, warmup)
    decay = (progress - warmup_progress) / max(1.0 - warmup_progress, 1e-9)
    decay = min(max(decay, 0.0), 1.0)
    if schedule == "linear":
        return scale * peak * (1.0 - decay)
    if schedule == "cosine":
        return scale * peak * 0.5 * (1.0 + math.cos(math.pi * decay))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; expected one of {SCHEDULES}")
