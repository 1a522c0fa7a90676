"""Errors that are the user's to fix (or to know about): entry points print them as one line."""

from pathlib import Path


class ConfigError(Exception):
    """A config key that is unknown or has a value of the wrong type or range."""


class TrainingStopped(Exception):
    """Training ended early on purpose (a signal) or because it cannot go on (non-finite values).

    `exit_code` is what the entry point exits with; the message says what happened and, given
    `resume_dir` (the run directory a rerun continues), how to go on."""

    def __init__(self, message: str, exit_code: int, resume_dir: Path | None = None):
        resume = f". Resume with: python train.py <same overrides> hydra.run.dir={resume_dir}" if resume_dir else ""
        super().__init__(message + resume)
        self.what, self.exit_code = message, exit_code
