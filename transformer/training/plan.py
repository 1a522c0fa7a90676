"""What the training budget decides as a run goes: the fraction of it used, the learning rate at
each step (schedule.py's formulas), and once, early in the run, the dropout.

Under a wall-clock budget the same recipe trains a few epochs on a slow CPU and many on a fast
one, and many epochs of a small corpus call for more regularization than a few. With
`trainer.long_budget_epochs` > 0, once PLAN_AT of the budget is used the trainer estimates the
epochs the whole budget holds, as the epochs trained so far divided by the fraction of the
budget they used; a budget of at least `long_budget_epochs` then trains with
`trainer.long_budget_dropout` as the model's dropout (`model.dropout`: on the embeddings and
every sublayer output) from the next step on. The estimate and the dropout are saved with the
run's state (TrainState), so a resumed run keeps the decision. The dropout is set on the model's
modules only: its config keeps model.dropout as configured, which is what checkpoints save."""

from __future__ import annotations

from .batches import EpochBatches, TrainState
from .schedule import scheduled_lr, warmup_ramp

PLAN_AT = 0.02  # the fraction of the budget after which the plan is made


def planned_epochs(epochs_done: float, progress: float) -> float:
    """The epochs the whole budget holds, from the epochs trained so far and the fraction of the
    budget they used."""
    return epochs_done / progress


def planned_dropout(epochs: float, tcfg, dropout: float) -> float:
    """The model's dropout for a budget of `epochs`: trainer.long_budget_dropout for a long
    budget, else `dropout` (model.dropout)."""
    if tcfg.long_budget_epochs and epochs >= tcfg.long_budget_epochs:
        return tcfg.long_budget_dropout
    return dropout


class BudgetPlan:
    """The budget's decisions for one run: `tcfg` (the trainer config) holds the budget and the
    schedule, `dropout` is model.dropout as configured, `batches` tells the epoch's size."""

    def __init__(self, tcfg, dropout: float, batches: EpochBatches):
        self.tcfg, self.dropout, self.batches = tcfg, dropout, batches

    def progress(self, state: TrainState, seconds: float) -> float:
        """The fraction of the training budget used before the current step: of the steps, epochs,
        tokens or minutes, whichever limit is nearest. (Before, so the last step still learns.)"""
        t = self.tcfg
        used = [(state.step - 1) / t.max_steps]
        if t.max_minutes:
            used.append(seconds / (60 * t.max_minutes))
        if t.max_tokens_seen:
            used.append(state.train_tokens / t.max_tokens_seen)
        if t.max_epochs:
            used.append(state.epochs_done(self.batches.epoch_size, unconsumed=t.accumulate) / t.max_epochs)
        return min(max(used), 1.0)

    def learning_rate(self, state: TrainState, seconds: float) -> float:
        """The current step's learning rate; records in `state` where warmup ended."""
        t = self.tcfg
        progress = self.progress(state, seconds)
        ramp = warmup_ramp(state.step, t.warmup_steps, progress, t.warmup_fraction)
        if ramp >= 1 and not state.warmup_end:
            state.warmup_end = min(state.step, t.warmup_steps)  # a run resumed from before warmup_end was saved
            if state.warmup_end == state.step:
                state.warmup_progress = progress
        warmup = state.warmup_end or t.warmup_steps
        return scheduled_lr(t.schedule, state.step, t.lr, warmup, progress, state.warmup_progress, t.cooldown, ramp)

    def plan_dropout(self, model, state: TrainState, seconds: float) -> str | None:
        """Once PLAN_AT of the budget is used: estimate the epochs it holds, choose the dropout for
        them (both kept in `state`) and set it on `model`. Returns the line to log; None otherwise."""
        if not self.tcfg.long_budget_epochs or state.planned_epochs:
            return None
        progress = self.progress(state, seconds)
        if progress < PLAN_AT:
            return None
        state.planned_epochs = planned_epochs(state.epochs_done(self.batches.epoch_size), progress)
        state.planned_dropout = planned_dropout(state.planned_epochs, self.tcfg, self.dropout)
        model.set_dropout(state.planned_dropout)
        after = state.planned_dropout
        change = f"dropout {after:g} from the next step on" if after != self.dropout else f"dropout stays {after:g}"
        return (
            f"the budget holds about {state.planned_epochs:.1f} epochs (estimated at step {state.step}), "
            f"trainer.long_budget_epochs={self.tcfg.long_budget_epochs:g}: {change}"
        )

    def apply(self, model, state: TrainState) -> None:
        """The dropout `state` planned, on `model` again after a resume. (A checkpoint from before
        the dropout was saved with the state has the epochs it follows from.)"""
        if state.planned_epochs and state.planned_dropout is None:
            state.planned_dropout = planned_dropout(state.planned_epochs, self.tcfg, self.dropout)
        if state.planned_dropout is not None:
            model.set_dropout(state.planned_dropout)
