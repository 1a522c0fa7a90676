"""A many-to-many run beside bilingual runs of the same directions, as docs/RESULTS.md reports it:
for each test split and direction, BLEU and chrF of the bilingual model and of the many-to-many
model, their difference, and the means over the directions.

    python scripts/lab/many_table.py many=outputs/many/RUN bilingual=[outputs/de-en/RUN,outputs/en-de/RUN,...]

Each run directory's results.json is read (train.py writes it after testing the best checkpoint):
a many-to-many run's keys are <split>/<direction>/<decoding>, a bilingual run's <split>/<decoding>
with its direction in .hydra/config.yaml. A direction without a bilingual run gets its
many-to-many scores alone. Paired significance tests of two hypothesis files: evaluate.py compare=.

Arguments (key=value):
    many=DIR            the many-to-many run
    bilingual=[DIR,...] bilingual runs, one per direction
    decoding=beam5      which scores: beam5 or greedy
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from transformer.cli import parse_args
from transformer.errors import ConfigError, exit_on_user_error


@dataclass
class TableConfig:
    many: str = "???"
    bilingual: list[str] = field(default_factory=list)
    decoding: str = "beam5"


def results(run: Path) -> dict:
    path = run / "results.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: is {run} a finished train.py run?")
    return json.loads(path.read_text())["test"]


def bilingual_scores(runs: list[str], decoding: str) -> dict[tuple[str, str], dict]:
    """{(split, direction): scores} of bilingual runs."""
    out = {}
    for run in map(Path, runs):
        data = OmegaConf.load(run / ".hydra" / "config.yaml").data
        for key, scores in results(run).items():
            split, label = key.split("/")
            if label == decoding:
                out[split, f"{data.src_lang}-{data.tgt_lang}"] = scores
    return out


def mean(pairs: list[tuple[dict, dict]], side: int, key: str) -> float:
    return sum(pair[side][key] for pair in pairs) / len(pairs)


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, TableConfig, __doc__)
        many = {tuple(key.split("/")[:2]): s for key, s in results(Path(cfg.many)).items() if key.endswith(f"/{cfg.decoding}") and key.count("/") == 2}  # fmt: skip
        single = bilingual_scores(cfg.bilingual, cfg.decoding)
        for split in dict.fromkeys(split for split, _ in many):
            print(
                f"\n| {split} ({cfg.decoding}) | bilingual BLEU / chrF | many-to-many BLEU / chrF | difference (BLEU) |"
            )
            print("|---|---|---|---:|")
            pairs = []
            for (s, name), scores in many.items():
                if s != split or name == "mean":
                    continue
                other = single.get((split, name))
                mine = f"{scores['bleu']:.2f} / {scores['chrf']:.2f}"
                if other is None:
                    print(f"| {name} | – | {mine} | |")
                    continue
                pairs.append((other, scores))
                print(f"| {name} | {other['bleu']:.2f} / {other['chrf']:.2f} | {mine} | {scores['bleu'] - other['bleu']:+.2f} |")  # fmt: skip
            if pairs:
                (b0, c0), (b1, c1) = ((mean(pairs, i, "bleu"), mean(pairs, i, "chrf")) for i in (0, 1))
                print(f"| mean of {len(pairs)} | {b0:.2f} / {c0:.2f} | {b1:.2f} / {c1:.2f} | {b1 - b0:+.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
