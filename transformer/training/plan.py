"""A setting that follows from how many epochs the training budget holds, decided early in a run.

Under a wall-clock budget the same recipe trains a few epochs on a slow CPU and many on a fast
one, and many epochs of a small corpus call for more regularization than a few. With
`trainer.long_budget_epochs` > 0, once PLAN_AT of the budget is used the trainer estimates the
epochs the whole budget holds, as the epochs trained so far divided by the fraction of the
budget they used; a budget of at least `long_budget_epochs` then trains with
`trainer.long_budget_dropout` as the model's dropout (`model.dropout`: on the embeddings and
every sublayer output) from the next step on. The estimate is saved with the run's state, so a
resumed run keeps the decision."""

from __future__ import annotations

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


def plan_dropout(model, state, tcfg, dropout: float, progress: float, epoch_size: int) -> str | None:
    """Once PLAN_AT of the budget is used: estimate the epochs it holds (kept in the run's
    `state`) and set the model's dropout for them. Returns the line to log; None before then."""
    if progress < PLAN_AT:
        return None
    state.planned_epochs = planned_epochs(state.epochs_done(epoch_size), progress)
    before = model.cfg.dropout
    apply_plan(model, state, tcfg, dropout)
    after = model.cfg.dropout
    change = f"dropout {after:g} from the next step on" if after != before else f"dropout stays {before:g}"
    return (
        f"the budget holds about {state.planned_epochs:.1f} epochs (estimated at step {state.step}), "
        f"trainer.long_budget_epochs={tcfg.long_budget_epochs:g}: {change}"
    )


def apply_plan(model, state, tcfg, dropout: float) -> None:
    """The model's dropout for the epochs `state` planned (again, after a resume)."""
    model.set_dropout(planned_dropout(state.planned_epochs, tcfg, dropout))
