"""What translate.py, evaluate.py and the scripts share: their arguments composed by Hydra onto a
dataclass, the inputs of a script that scores a checkpoint, and logging to stderr. Loading a
checkpoint (or an ensemble) to decode with is transformer.translator.Translator.load."""

from __future__ import annotations

import gc
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .checkpoint import direction, language_pair  # the first of this package's modules to import torch

# torch's ~100k objects are moved out of the garbage collector's sight as soon as they exist: the
# collections that importing Hydra and the rest would run walk them no more (0.075 s of a command's
# start-up), nor do the collections while the command runs, nor its last one at exit (parse_args
# freezes again what came later).
gc.freeze()

from .config import compose_command  # noqa: E402
from .data import DataConfig, corpus_file  # noqa: E402
from .errors import ConfigError  # noqa: E402
from .runtime import RuntimeConfig  # noqa: E402


def parse_args(argv: list[str], schema: type, doc: str, name: str | None = None):
    """A command's arguments -> a validated `schema` instance, composed by Hydra from configs/ as
    train.py's are (transformer.config.compose_command): key=value overrides, decode=NAME and
    runtime=NAME for the typed fields that have a config group, --help, --cfg job. `name`: the
    command's name (default: the name of the script that runs).

    Everything imported so far (torch and its ~100k objects) is moved out of the garbage
    collector's sight: neither its collections while the command runs nor its last one at exit
    walk them again (that walk alone is 0.4 s of a one-sentence translate.py)."""
    gc.freeze()
    return compose_command(argv, schema, doc, name or Path(sys.argv[0]).stem or "command")


@dataclass
class ScoringInputs:
    """The arguments of a script that scores a checkpoint: the model (or an ensemble), the speed
    paths to run it with, and the corpus to decode, a split of the training run's corpus or a
    source and reference file."""

    checkpoint: str = "???"
    ensemble: list[str] = field(default_factory=list)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # runtime.fast=false: the reference model
    split: str = "test_2016_flickr"
    data_dir: Optional[str] = None
    src_lang: Optional[str] = None
    tgt_lang: Optional[str] = None
    src: Optional[str] = None
    ref: Optional[str] = None


def source_and_reference(cfg: ScoringInputs, train_config: dict) -> tuple[Path, Path]:
    """The source and reference files to score: cfg.src and cfg.ref when given, else the split
    cfg.split of the training run's corpus (cfg.data_dir, cfg.src_lang, cfg.tgt_lang override it)."""
    if (cfg.src is None) != (cfg.ref is None):
        raise ConfigError("give both src=PATH and ref=PATH, or neither (then split= is used)")
    pair = language_pair(train_config)
    if cfg.src is not None:
        check_file_languages(cfg, pair)
        return Path(cfg.src), Path(cfg.ref)
    check_split_languages(cfg, pair)
    data = train_config.get("data", {})
    directory = Path(cfg.data_dir or data.get("dir", DataConfig.dir))
    src_lang, tgt_lang = cfg.src_lang or data.get("src_lang"), cfg.tgt_lang or data.get("tgt_lang")
    return corpus_file(directory, cfg.split, src_lang), corpus_file(directory, cfg.split, tgt_lang)


def check_split_languages(cfg: ScoringInputs, pair) -> None:
    """src_lang= and tgt_lang= must be languages the checkpoint translates from and into."""
    if pair is None:
        return
    sources, target = pair
    for key, lang, fits in (("src_lang", cfg.src_lang, cfg.src_lang in sources), ("tgt_lang", cfg.tgt_lang, cfg.tgt_lang == target)):  # fmt: skip
        if lang is not None and not fits:
            raise ConfigError(f"{key}={lang}, but {cfg.checkpoint} translates {direction(pair)}")


def check_file_languages(cfg: ScoringInputs, pair) -> None:
    """A src= file named in the checkpoint's target language, or a ref= file named in one of its
    source languages, is the wrong way round."""
    if pair is None:
        return
    sources, target = pair
    src_lang, ref_lang = file_language(cfg.src), file_language(cfg.ref)
    if src_lang == target and src_lang not in sources:
        raise ConfigError(f"src={cfg.src} is in {src_lang}, but {cfg.checkpoint} translates {direction(pair)}")
    if ref_lang in sources and ref_lang != target:
        raise ConfigError(f"ref={cfg.ref} is in {ref_lang}, but {cfg.checkpoint} translates {direction(pair)}")


def file_language(path: str | None) -> str | None:
    """The language code a file name ends in, as in test.de or test.de.gz (None without one)."""
    if path is None:
        return None
    return Path(Path(path).name.removesuffix(".gz")).suffix[1:] or None


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)
