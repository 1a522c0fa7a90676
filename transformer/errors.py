"""Errors that are the user's to fix (or to know about): entry points print them as one line."""


class ConfigError(Exception):
    """A config key that is unknown or has a value of the wrong type or range."""


class TrainingStopped(Exception):
    """Training ended early on purpose (a signal) or because it cannot go on (non-finite values).

    `exit_code` is what the entry point exits with; the message says what happened and, with
    `resume` (the command that continues the run), how to go on."""

    def __init__(self, message: str, exit_code: int, resume: str | None = None):
        super().__init__(message if resume is None else f"{message}. Resume with: {resume}")
        self.what, self.exit_code = message, exit_code
