"""What train.py calls: one run (experiment.py), or with trainer.members > 1 several at once,
ensembled (members.py)."""

from __future__ import annotations

from pathlib import Path

from ..data.tokenizer import Tokenizer
from ..devices import pick_device, require_cpp_compiler
from ..errors import ConfigError
from . import distributed, finetune
from .experiment import run_one
from .members import run_members


def run(
    cfg,
    run_dir: Path,
    tests: bool = True,
    tokenizer: Tokenizer | None = None,
    record: dict | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Train (or resume), then evaluate the best checkpoint, or the members' ensemble, on the test
    splits (unless tests=False); returns the test scores. The arguments are those of
    `experiment.run_one`; `overrides` (train.py's command line) are checked against init_from's
    checkpoint, whose architecture replaces cfg.model (finetune.py)."""
    if cfg.init_from:
        init = finetune.load_init(cfg.init_from)
        finetune.check_overrides(cfg, overrides or [], init)
        cfg = finetune.configure(cfg, init)
    if cfg.trainer.compile:
        require_cpp_compiler(pick_device(cfg.trainer.device))
    if cfg.trainer.members > 1:
        if distributed.launched():
            raise ConfigError("trainer.members > 1 trains in separate processes; it cannot run under torchrun")
        return run_members(cfg, Path(run_dir), record)
    return run_one(cfg, run_dir, tests, tokenizer, record)
