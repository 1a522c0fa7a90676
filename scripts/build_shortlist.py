"""Build a lexical shortlist for a checkpoint: the target pieces each source piece most likely
translates into (IBM Model 1 on the training pairs) and the most frequent target pieces.

    python scripts/build_shortlist.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt
    python translate.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt decode.shortlist=true < in.de

Arguments (key=value):
    checkpoint=PATH   a checkpoint written by train.py; the shortlist goes beside it (shortlist.tsv,
                      one per run directory), where translate.py, evaluate.py, serve.py and the
                      CTranslate2 export find it
    source=FILE target=FILE   parallel text to build from (default: the run's training split)
    first=100         the most frequent target pieces, which every batch may use
    best=50           target pieces kept per source piece
    rounds=5          EM rounds of IBM Model 1
    output=PATH       where to write it (default: shortlist.tsv beside the checkpoint)
    overwrite=false

The file is CTranslate2's vocabulary map (source piece, TAB, its target pieces; the empty key
holds the frequent ones). docs/DECODING.md says what it costs in BLEU and gains in speed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from transformer.checkpoint import directions_of, language_pair, load_model
from transformer.cli import parse_args
from transformer.data.corpus import corpus_file, read_parallel
from transformer.decoding.shortlist import build_for, shortlist_path
from transformer.errors import ConfigError, exit_on_user_error
from transformer.files import check_output


@dataclass
class ShortlistConfig:
    checkpoint: str = "???"
    source: Optional[str] = None
    target: Optional[str] = None
    first: int = 100
    best: int = 50
    rounds: int = 5
    output: Optional[str] = None
    overwrite: bool = False

    def __post_init__(self) -> None:
        for key, low in (("first", 0), ("best", 1), ("rounds", 1)):
            if getattr(self, key) < low:
                raise ValueError(f"{key}={getattr(self, key)} must be >= {low}")
        if (self.source is None) != (self.target is None):
            raise ValueError("give both source= and target=, or neither (the run's training split)")


def training_files(cfg: ShortlistConfig, train_config: dict) -> list[tuple[Path, Path]]:
    """The parallel files to build from: source= and target=, or the run's training split (every
    source language of a many-to-one run, every direction of a many-to-many one)."""
    if cfg.source is not None:
        return [(Path(cfg.source), Path(cfg.target))]
    data = train_config.get("data", {}) if isinstance(train_config, dict) else {}
    if data.get("hub_name"):
        raise ConfigError(f"{cfg.checkpoint} was trained on {data['hub_name']} from the Hub: give source= and target= files")  # fmt: skip
    directory, split = Path(data.get("dir", "data/multi30k")), data.get("train_split", "train")
    pair = language_pair(train_config)
    ways = [name.split("-") for name in directions_of(train_config)] or ([(s, pair[1]) for s in pair[0]] if pair else [])  # fmt: skip
    if not ways:
        raise ConfigError(f"{cfg.checkpoint} does not say what it was trained on: give source= and target= files")
    return [(corpus_file(directory, split, s), corpus_file(directory, split, t)) for s, t in ways]


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, ShortlistConfig, __doc__)
        checkpoint = Path(cfg.checkpoint)
        _, tokenizer, payload = load_model(checkpoint)
        files = training_files(cfg, payload.get("train_config", {}))
        default = shortlist_path(checkpoint)
        output = Path(cfg.output) if cfg.output else default
        if output.exists() and not cfg.overwrite:
            raise ConfigError(f"output={output} exists: give overwrite=true to replace it")
        output = check_output(output, [checkpoint, *(p for pair in files for p in pair)])
        start = time.perf_counter()
        sources, targets = [], []
        for src_path, tgt_path in files:
            src_text, tgt_text = read_parallel(src_path, tgt_path)
            sources += src_text
            targets += tgt_text
        shortlist = build_for(tokenizer, sources, targets, cfg.first, cfg.best, cfg.rounds)
        shortlist.save(output, tokenizer.source.id_to_piece, tokenizer.id_to_piece)
        seconds = time.perf_counter() - start
        names = ", ".join(f"{s.name}/{t.name}" for s, t in files)
        print(f"shortlist of {len(sources)} pairs ({names}) in {seconds:.1f} s: {len(shortlist.fixed)} frequent target pieces, up to {shortlist.best} per source piece -> {output}")  # fmt: skip
        if output != default:
            print(f"decode.shortlist=true reads {default}: move it there to use it")


if __name__ == "__main__":
    main(sys.argv[1:])
