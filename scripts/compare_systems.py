"""Is one system's translation of a test set better than another's, or is the difference chance?
sacreBLEU's paired bootstrap and approximate randomization tests between two hypothesis files on
the same references, for BLEU and chrF, with the difference's 95% confidence interval
(transformer/significance.py, docs/DECODING.md). No checkpoint needed: e.g. the
`<split>.beam5.en` files two training runs wrote.

    python scripts/compare_systems.py baseline=RUN_A/test_2016_flickr.beam5.en \\
        system=RUN_B/test_2016_flickr.beam5.en ref=data/multi30k/test_2016_flickr.en.gz

Arguments (key=value, as for train.py):
    baseline=PATH system=PATH ref=PATH   one line per sentence each (plain or .gz)
    lowercase=false   case-insensitive BLEU (sacreBLEU -lc)
    seed=12345        the tests' random draws
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from transformer.cli import parse_args, setup_logging
from transformer.data import read_parallel
from transformer.errors import exit_on_user_error
from transformer.significance import compare


@dataclass
class CompareConfig:
    baseline: str = "???"
    system: str = "???"
    ref: str = "???"
    lowercase: bool = False
    seed: int = 12345

    def __post_init__(self) -> None:
        if self.seed < 1:  # sacreBLEU reads a seed of 0 as "no seed"
            raise ValueError(f"seed={self.seed} must be >= 1")


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, CompareConfig, __doc__)
        baseline, references = read_parallel(Path(cfg.baseline), Path(cfg.ref))
        system, _ = read_parallel(Path(cfg.system), Path(cfg.ref))
        print(f"system={cfg.system} against baseline={cfg.baseline} on {cfg.ref} (seed {cfg.seed}):")
        for result in compare(baseline, system, references, cfg.lowercase, cfg.seed):
            print("  " + result.summary())


if __name__ == "__main__":
    main(sys.argv[1:])
