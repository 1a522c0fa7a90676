"""Typed run configuration. The only module that knows the shape of the Hydra config in configs/.

Entry points compose a DictConfig with Hydra and call `to_config`; library code receives these
dataclasses and never imports Hydra.
"""

from __future__ import annotations

import errno
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .checkpoint import CheckpointError
from .data import DataConfig, DataError
from .decoding import DecodeConfig
from .errors import ConfigError, TrainingStopped
from .files import WriteError
from .model import ModelConfig
from .trainer_config import TrainerConfig


@dataclass
class Config:
    name: str = "run"
    seed: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


def to_config(cfg: DictConfig, schema: type = Config):
    """Validate a composed config against the dataclasses (unknown keys, types, ranges)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(one_line(e)) from None
    except ValueError as e:  # raised by a dataclass's __post_init__ check
        raise ConfigError(str(e)) from None


def one_line(error: OmegaConfBaseException) -> str:
    message = str(error).strip().splitlines()[0]
    key = getattr(error, "full_key", None)
    return f"config key {key}: {message}" if key else message


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
