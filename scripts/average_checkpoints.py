"""Average the weights of the last N checkpoints of a run into one checkpoint.

    python scripts/average_checkpoints.py run=outputs/de-en/RUN last=5
    python scripts/average_checkpoints.py inputs=[a.pt,b.pt] output=averaged.pt

The result (default: RUN/checkpoint_avg<N>.pt) works with translate.py and evaluate.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from transformer import checkpoint
from transformer.cli import parse_args
from transformer.errors import ConfigError, exit_on_user_error
from transformer.files import check_output


@dataclass
class AverageConfig:
    run: Optional[str] = None  # a run directory: its numbered checkpoints checkpoint_<step>.pt
    last: int = 5
    inputs: list[str] = field(default_factory=list)  # or explicit checkpoint files
    output: Optional[str] = None

    def __post_init__(self) -> None:
        if self.last < 1:  # a slice [-last:] would take every checkpoint (0) or drop some (< 0)
            raise ValueError(f"last={self.last} must be >= 1")


def checkpoints_to_average(cfg: AverageConfig) -> list[Path]:
    if bool(cfg.run) == bool(cfg.inputs):
        raise ConfigError("give run=RUN_DIR (with last=N) or inputs=[PATH,...], not both")
    if cfg.inputs:
        return [Path(p) for p in cfg.inputs]
    numbered = checkpoint.numbered(Path(cfg.run))
    if len(numbered) < cfg.last:
        raise ConfigError(f"last={cfg.last}, but {cfg.run} has {len(numbered)} numbered checkpoints")
    return numbered[-cfg.last :]


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, AverageConfig, __doc__)
        paths = checkpoints_to_average(cfg)
        output = check_output(cfg.output or paths[-1].parent / f"checkpoint_avg{len(paths)}.pt", paths)
        checkpoint.write(output, checkpoint.average(paths))
        print(f"averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) into {output}")


if __name__ == "__main__":
    main(sys.argv[1:])
