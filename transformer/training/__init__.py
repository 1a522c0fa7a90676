"""Training: the loop apart from the objective, the optimizer and schedules, and apart from the
orchestration of runs.

    config.py      TrainerConfig, the `trainer:` config group
    trainer.py     the loop: batches, one optimizer step, validation, checkpoints, early stopping
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

from .batches import TrainState
from .launch import run
from .trainer import Trainer

__all__ = ["TrainState", "Trainer", "run"]
