"""Errors that are the user's to fix (or to know about), and how entry points report them: one
'error: ...' line on stderr and exit status 2, no traceback (exit_on_user_error)."""

import errno
import sys
from contextlib import contextmanager
from pathlib import Path


class ConfigError(Exception):
    """A config key that is unknown or has a value of the wrong type or range."""


class DataError(Exception):
    """Bad input data; the message names the file, line or key at fault."""


class CheckpointError(Exception):
    """A file that is not a loadable checkpoint of this format; the message names it."""


class WriteError(OSError):
    """An OSError raised while writing an output; `filename` is the output's path."""


class TrainingStopped(Exception):
    """Training ended early on purpose (a signal) or because it cannot go on (non-finite values).

    `exit_code` is what the entry point exits with; the message says what happened and, given
    `resume_dir` (the run directory a rerun continues), how to go on."""

    def __init__(self, message: str, exit_code: int, resume_dir: Path | None = None):
        resume = f". Resume with: python train.py <same overrides> hydra.run.dir={resume_dir}" if resume_dir else ""
        super().__init__(message + resume)
        self.what, self.exit_code = message, exit_code


USER_ERRORS = (ConfigError, DataError, CheckpointError)


@contextmanager
def exit_on_user_error():
    """Turn a user's mistake into one 'error: ...' line on stderr and exit status 2, no traceback."""
    try:
        yield
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except TrainingStopped as e:
        print(str(e), file=sys.stderr)
        sys.exit(e.exit_code)
    except OSError as e:  # permission denied, read-only file system, disk full, a directory, ...
        print(f"error: {io_error(e)}", file=sys.stderr)
        sys.exit(2)


WRITE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG}


def io_error(e: OSError) -> str:
    """'cannot write PATH: reason' (or read): one line for a failed file operation."""
    verb = "write" if isinstance(e, WriteError) or e.errno in WRITE_ERRNOS else "read"
    where = f" {e.filename}" if e.filename else ""
    return f"cannot {verb}{where}: {e.strerror or e}"
