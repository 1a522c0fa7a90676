"""Parallel corpora -> `datasets.Dataset` of text pairs (their token ids and batches: batching.py).

A corpus is two aligned files per split, `{dir}/{split}.{lang}` or `{dir}/{split}.{lang}.gz`,
one sentence per line (the Multi30k layout), or a dataset on the Hugging Face Hub.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import math
import sys
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..errors import DataError
from ..files import atomic_write_text

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)


SPM_MODEL_TYPES = ("unigram", "bpe", "char", "word")


def _datasets():
    """The `datasets` library, imported when a corpus is first loaded: decoding never needs it
    (it is half a second of start-up)."""
    import datasets

    datasets.disable_progress_bars()
    return datasets


@dataclass
class DataConfig:
    dir: str = "data/multi30k"  # local corpus directory (ignored when hub_name is set)
    hub_name: Optional[str] = None  # e.g. "bentrevett/multi30k"; needs network access
    hub_config: Optional[str] = None
    src_lang: str = "de"
    tgt_lang: str = "en"
    train_split: str = "train"
    valid_split: str = "val"
    test_splits: list[str] = field(default_factory=lambda: ["test_2016_flickr", "test_2017_flickr"])
    vocab_size: int = 8000  # pieces of the SentencePiece vocabulary (of each one, with joint_vocab=false)
    joint_vocab: bool = True  # one vocabulary and embedding for both languages; false: one per language
    spm_model_type: str = "unigram"  # or "bpe", "char", "word"
    max_tokens: int = 4096  # padded tokens per batch and side
    max_len: int = 256  # training pairs with a longer side (in tokens) are dropped
    streaming: bool = False  # keep the training split in memory-mapped Arrow files, for corpora larger than memory
    spm_sample: int = 2_000_000  # sentences sampled to train SentencePiece (all, when fewer)
    subword_alpha: float = 0.0  # > 0: a new random segmentation of the training split each epoch (SubwordSampler)
    subword_nbest: int = 64  # ... drawn from each sentence's this many best segmentations
    # Many-to-one: the training split also pairs these languages' sentences with the same targets
    # (e.g. [fr, cs] beside en -> de on Multi30k); validation and test stay src_lang -> tgt_lang.
    extra_src_langs: list[str] = field(default_factory=list)
    # Many-to-many: one model for every listed direction, e.g. [de-en, en-de, fr-en]; each source
    # starts with its target language's tag (<2en>). Empty: the one direction src_lang -> tgt_lang.
    directions: list[str] = field(default_factory=list)
    # With directions: direction d's share of the training pairs (and each language's share of the
    # tokenizer's text) is proportional to its size ** (1 / temperature); 1 keeps the corpus' own
    # shares, larger values raise the small directions towards equal shares (Arivazhagan et al., 2019).
    temperature: float = 5.0

    def __post_init__(self) -> None:
        self.check_sizes()
        self.check_names()
        if not 0 <= self.subword_alpha < math.inf:
            raise ValueError(f"data.subword_alpha={self.subword_alpha} must be >= 0 (0: no subword sampling)")
        if self.subword_alpha > 0 and self.spm_model_type != "unigram":
            raise ValueError(f"data.subword_alpha needs data.spm_model_type=unigram, not {self.spm_model_type!r}")
        if self.subword_alpha > 0 and self.subword_nbest < 2:
            raise ValueError(f"data.subword_nbest={self.subword_nbest} must be at least 2 to sample from")
        if self.subword_alpha > 0 and self.streaming:
            raise ValueError("data.subword_alpha re-segments the training split in memory; it cannot be used with data.streaming=true")  # fmt: skip
        for lang in self.extra_src_langs:
            if lang in (self.src_lang, self.tgt_lang):
                raise ValueError(f"data.extra_src_langs: {lang!r} is already data.src_lang or data.tgt_lang")
            if list(self.extra_src_langs).count(lang) > 1:
                raise ValueError(f"data.extra_src_langs: {lang!r} is listed twice")
        self.check_directions()

    def check_sizes(self) -> None:
        # vocab_size: more pieces than the 4 special ones (pad, unk, bos, eos); max_len: a token and
        # EOS; spm_sample: 0 trains SentencePiece on every sentence.
        for key, low in (("vocab_size", 5), ("max_tokens", 1), ("max_len", 2), ("spm_sample", 0), ("subword_nbest", 1)):
            if getattr(self, key) < low:
                raise ValueError(f"data.{key}={getattr(self, key)} must be >= {low}")
        if self.spm_model_type not in SPM_MODEL_TYPES:
            raise ValueError(f"data.spm_model_type={self.spm_model_type!r} is not one of {SPM_MODEL_TYPES}")

    def check_directions(self) -> None:
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"data.temperature={self.temperature} must be > 0 and finite")
        for name in self.directions:
            langs = str(name).split("-")
            if len(langs) != 2 or not all(langs) or langs[0] == langs[1]:
                raise ValueError(f"data.directions: {name!r} is not a direction like de-en (source-target)")
            if list(self.directions).count(name) > 1:
                raise ValueError(f"data.directions: {name!r} is listed twice")
        if self.directions and self.extra_src_langs:
            raise ValueError("data.directions and data.extra_src_langs both list the languages: use data.directions")
        if self.directions and (self.streaming or self.subword_alpha > 0 or not self.joint_vocab):
            raise ValueError("data.directions needs one joint vocabulary in memory: data.joint_vocab=true, data.streaming=false, data.subword_alpha=0")  # fmt: skip

    @property
    def multilingual(self) -> bool:
        """True for a many-to-many run (data.directions): every source carries a target tag."""
        return bool(self.directions)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """The (source, target) languages of every direction trained: data.directions, or the one pair."""
        if self.directions:
            return [tuple(str(name).split("-")) for name in self.directions]
        return [(self.src_lang, self.tgt_lang)]

    @property
    def languages(self) -> list[str]:
        """Every language of the directions, in order of first appearance."""
        return list(dict.fromkeys(lang for pair in self.pairs for lang in pair))

    def check_names(self) -> None:
        if self.src_lang == self.tgt_lang:
            raise ValueError(f"data.src_lang and data.tgt_lang are both {self.src_lang!r}")
        for key in ("src_lang", "tgt_lang", "train_split", "valid_split"):
            if not getattr(self, key):
                raise ValueError(f"data.{key} is empty")
        for key in ("test_splits", "extra_src_langs"):
            if not all(getattr(self, key)):
                raise ValueError(f"data.{key}={list(getattr(self, key))} holds an empty name")


# --- Reading ------------------------------------------------------------------------------------


def read_lines(path: Path) -> list[str]:
    """All lines of a plain or gzip UTF-8 file, stripped of surrounding whitespace."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    return decode_lines(raw, str(path))


def decode_lines(raw: bytes, name: str) -> list[str]:
    """The lines of UTF-8 text read from `name` (a file, or standard input), stripped."""
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    try:
        return [line.decode("utf-8").strip() for line in lines]
    except UnicodeDecodeError:
        bad = next(i for i, line in enumerate(lines, 1) if not _is_utf8(line))
        raise DataError(f"{name}:{bad}: line is not valid UTF-8") from None


def line_chunks(path: Path | None, size: int) -> Iterator[list[str]]:
    """The lines of a plain or gzip UTF-8 file, or of standard input (path None), stripped, in lists
    of at most `size` lines. Each list comes as soon as it is full (a reader of a pipe or terminal
    gets lines as they arrive) and memory stays bounded whatever the input's length."""
    name = "standard input" if path is None else str(path)
    opener = gzip.open if path is not None and path.suffix == ".gz" else open
    try:
        with nullcontext(sys.stdin.buffer) if path is None else opener(path, "rb") as f:
            chunk = []
            for number, raw in enumerate(f, 1):
                try:
                    chunk.append(raw.decode("utf-8").strip())
                except UnicodeDecodeError:
                    raise DataError(f"{name}:{number}: line is not valid UTF-8") from None
                if len(chunk) == size:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {name}: {getattr(e, 'strerror', None) or e}") from None


def _is_utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def has_corpus_file(directory: Path, split: str, lang: str) -> bool:
    """Whether the split has a file in `lang` ({split}.{lang} or {split}.{lang}.gz), as corpus_file finds it."""
    return any((Path(directory) / f"{split}.{lang}{gz}").is_file() for gz in (".gz", ""))


def corpus_file(directory: Path, split: str, lang: str) -> Path:
    for name in (f"{split}.{lang}.gz", f"{split}.{lang}"):
        if (directory / name).is_file():
            return directory / name
    if not directory.is_dir():
        raise DataError(f"data directory {directory} does not exist (data.dir)")
    langs = sorted({p.name.split(".")[1] for p in directory.glob(f"{split}.*") if p.name.count(".") >= 1})
    if langs:
        raise DataError(
            f"unknown language code {lang!r}: no {directory}/{split}.{lang}[.gz]; available: {', '.join(langs)}"
        )
    raise DataError(f"missing data file {directory}/{split}.{lang}[.gz] (split {split!r})")


def load_split(cfg: DataConfig, split: str, pairs: list[tuple[str, str]] | None = None) -> datasets.Dataset:
    """One split as a Dataset with string columns "src" and "tgt". The training split with
    data.extra_src_langs holds each source language's pairs in turn, with a "src_lang" column.
    With data.directions (or `pairs`, some of them), the split holds each direction's pairs in
    turn, with "src_lang" and "tgt_lang" columns; its training split is resampled by
    data.temperature (resample)."""
    datasets = _datasets()
    if cfg.multilingual or pairs is not None:
        return load_directions(cfg, split, pairs or cfg.pairs)
    many = split == cfg.train_split and bool(cfg.extra_src_langs)
    langs = [cfg.src_lang, *cfg.extra_src_langs] if many else [cfg.src_lang]
    if cfg.hub_name:
        parts = _load_hub_split(cfg, split, langs)
    else:
        parts = [load_pairs(cfg, split, lang) for lang in langs]
    if not many:
        return parts[0]
    tag = lambda batch, lang: {"src_lang": [lang] * len(batch["src"])}  # noqa: E731
    tagged = [p.map(tag, fn_kwargs={"lang": lang}, batched=True, batch_size=10_000) for p, lang in zip(parts, langs)]
    return datasets.concatenate_datasets(tagged)


def load_directions(cfg: DataConfig, split: str, pairs: list[tuple[str, str]]) -> datasets.Dataset:
    """The pairs of each direction of one split, in turn, with "src_lang" and "tgt_lang" columns."""
    datasets = _datasets()
    parts = []
    for src, tgt in pairs:
        if cfg.hub_name:
            part = _load_hub_split(dataclasses.replace(cfg, src_lang=src, tgt_lang=tgt, directions=[]), split, [src])[0]
        else:
            part = load_pairs(cfg, split, src, tgt)
        langs = lambda batch, s, t: {"src_lang": [s] * len(batch["src"]), "tgt_lang": [t] * len(batch["src"])}  # noqa: E731
        parts.append(part.map(langs, fn_kwargs={"s": src, "t": tgt}, batched=True, batch_size=10_000))
    return datasets.concatenate_datasets(parts)


def load_pairs(cfg: DataConfig, split: str, src_lang: str, tgt_lang: str | None = None) -> datasets.Dataset:
    """The pairs src_lang -> tgt_lang (default cfg.tgt_lang) of one split of the local corpus."""
    datasets = _datasets()
    directory = Path(cfg.dir)
    src_path, tgt_path = (
        corpus_file(directory, split, src_lang),
        corpus_file(directory, split, tgt_lang or cfg.tgt_lang),
    )
    if cfg.streaming and split == cfg.train_split:
        return load_mapped(src_path, tgt_path)
    src, tgt = read_parallel(src_path, tgt_path)
    return datasets.Dataset.from_dict({"src": src, "tgt": tgt})


def primary_rows(ds: datasets.Dataset, src_lang: str) -> datasets.Dataset:
    """The pairs of a training split whose source is src_lang: with data.extra_src_langs each
    target repeats once per source language, and the tokenizer should see it once."""
    if "src_lang" not in ds.column_names:
        return ds
    return ds.filter(lambda langs: [x == src_lang for x in langs], input_columns="src_lang", batched=True)


def load_mapped(src_path: Path, tgt_path: Path) -> datasets.Dataset:
    """Two aligned files as a Dataset backed by memory-mapped Arrow files in the datasets cache
    (built once, in a streaming pass): rows are read from disk when used, not held in memory."""
    datasets = _datasets()
    sides = []
    for path, name in ((src_path, "src"), (tgt_path, "tgt")):
        try:
            ds = datasets.load_dataset("text", data_files=str(path), split="train")
        except datasets.exceptions.DatasetGenerationError as e:
            if isinstance(e.__cause__, UnicodeDecodeError):
                raise DataError(f"{path}:{first_bad_utf8_line(path)}: line is not valid UTF-8") from None
            raise DataError(f"cannot read {path}: {e.__cause__ or e}") from None
        sides.append(ds.rename_column("text", name))
    if len(sides[0]) != len(sides[1]):
        raise DataError(f"line counts differ: {src_path} has {len(sides[0])} lines, {tgt_path} has {len(sides[1])}")
    return datasets.concatenate_datasets(sides, axis=1)


def first_bad_utf8_line(path: Path) -> int:
    """The 1-based number of the first line that is not UTF-8, read line by line."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not _is_utf8(line):
                return number
    return 0


def read_parallel(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    """Two aligned files; their line counts must agree."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(f"line counts differ: {src_path} has {len(src)} lines, {tgt_path} has {len(tgt)}")
    return src, tgt


def write_lines(path: Path, lines: list[str]) -> None:
    """One line per item, UTF-8, each ending in a newline; atomically (a crash leaves no half file)."""
    try:
        atomic_write_text(path, "".join(line + "\n" for line in lines))
    except OSError as e:
        raise DataError(f"cannot write {path}: {e.strerror}") from None


def _load_hub_split(cfg: DataConfig, split: str, src_langs: list[str]) -> list[datasets.Dataset]:
    """The pairs of each source language with cfg.tgt_lang, from one load of the Hub split. Hub
    datasets come as a "translation" column of {lang: text} or as one column per language."""
    datasets = _datasets()
    ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=split)
    langs = [*src_langs, cfg.tgt_lang]
    if "translation" in ds.column_names:
        ds = ds.map(lambda ex: {lang: ex["translation"][lang] for lang in langs})
    for lang in langs:
        if lang not in ds.column_names:
            raise DataError(f"unknown language code {lang!r} for {cfg.hub_name}: columns are {ds.column_names}")
    pair = lambda ex, src, tgt: {"src": ex[src].strip(), "tgt": ex[tgt].strip()}  # noqa: E731
    return [ds.map(pair, fn_kwargs={"src": s, "tgt": cfg.tgt_lang}, remove_columns=ds.column_names) for s in src_langs]


# --- Training text -----------------------------------------------------------------------------


def training_text(ds: datasets.Dataset, columns=("src", "tgt")) -> Iterable[str]:
    """The sides of a split in `columns`, batch by batch, for SentencePiece (which samples
    data.spm_sample)."""
    for batch in ds.iter(batch_size=10_000):
        for column in columns:
            yield from (t.strip() for t in batch[column])


def clean_training_pairs(ds: datasets.Dataset, split_name: str) -> datasets.Dataset:
    """Drop pairs with an empty side and report how many; refuse an empty training set."""
    kept = ds.filter(
        lambda src, tgt: [bool(s.strip()) and bool(t.strip()) for s, t in zip(src, tgt)],
        input_columns=["src", "tgt"],
        batched=True,
        batch_size=10_000,
    )
    if len(kept) < len(ds):
        log.info("dropped %d of %d %s pairs with an empty side", len(ds) - len(kept), len(ds), split_name)
    if len(kept) == 0:
        raise DataError(f"the training split {split_name!r} has no non-empty sentence pairs")
    return kept
