"""Training: the loop apart from the objective, the optimizer and schedules, and apart from the
orchestration of runs.

    config.py      TrainerConfig, the `trainer:` config group
    trainer.py     the loop: one optimizer step, validation, early stopping, the log lines
    batches.py     the training batches, epoch after epoch, and the run's state (TrainState)
    plan.py        what the budget decides: the fraction used, the learning rate, the dropout
    checkpoints.py the checkpoint files: last (resumable), best, numbered; the best weights in memory
    objective.py   label-smoothed cross-entropy (the reference, over the full logits) and R-Drop
    optimizer.py   Adam, fused where torch has a fused kernel
    schedule.py    the learning rate at each step: the paper's warmup and decay, or to the budget
    validation.py  the validation loss and greedy BLEU that select the best checkpoint
    experiment.py  one run: data, tokenizer and model -> training -> test scores
    members.py     several runs at once, ensembled (trainer.members)
    distributed.py data parallelism across processes started by torchrun
    resume.py      random-generator states, resume checks, graceful stop on a signal
    launch.py      `run`, what train.py calls: one run or several ensembled

The speed paths training can use (the chunked loss, packed weights) are in transformer/fast/,
chosen by cfg.runtime; runtime.fast=false trains the reference model with the reference objective.
"""

import importlib

_EXPORTS = {"TrainState": ".batches", "Trainer": ".trainer", "run": ".launch"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """TrainState, Trainer and run, imported when first asked for: a command that only reads
    TrainerConfig (transformer/config.py, so every command) does not import the training loop."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
