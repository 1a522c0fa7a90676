"""Parallel corpora -> `datasets.Dataset` -> token-id pairs -> padded batches by token count.

A corpus is two aligned files per split, `{dir}/{split}.{lang}` or `{dir}/{split}.{lang}.gz`,
one sentence per line (the Multi30k layout), or a dataset on the Hugging Face Hub.
"""

from __future__ import annotations

import gzip
import logging
import math
import sys
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import datasets
import numpy as np
import torch
from torch import Tensor

from .errors import DataError
from .files import atomic_write_text

log = logging.getLogger(__name__)
datasets.disable_progress_bars()


SPM_MODEL_TYPES = ("unigram", "bpe", "char", "word")


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

    def check_sizes(self) -> None:
        # vocab_size: more pieces than the 4 special ones (pad, unk, bos, eos); max_len: a token and
        # EOS; spm_sample: 0 trains SentencePiece on every sentence.
        for key, low in (("vocab_size", 5), ("max_tokens", 1), ("max_len", 2), ("spm_sample", 0), ("subword_nbest", 1)):
            if getattr(self, key) < low:
                raise ValueError(f"data.{key}={getattr(self, key)} must be >= {low}")
        if self.spm_model_type not in SPM_MODEL_TYPES:
            raise ValueError(f"data.spm_model_type={self.spm_model_type!r} is not one of {SPM_MODEL_TYPES}")

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


def load_split(cfg: DataConfig, split: str) -> datasets.Dataset:
    """One split as a Dataset with string columns "src" and "tgt". The training split with
    data.extra_src_langs holds each source language's pairs in turn, with a "src_lang" column."""
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


def load_pairs(cfg: DataConfig, split: str, src_lang: str) -> datasets.Dataset:
    """The pairs src_lang -> cfg.tgt_lang of one split of the local corpus."""
    directory = Path(cfg.dir)
    src_path, tgt_path = corpus_file(directory, split, src_lang), corpus_file(directory, split, cfg.tgt_lang)
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
    ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=split)
    langs = [*src_langs, cfg.tgt_lang]
    if "translation" in ds.column_names:
        ds = ds.map(lambda ex: {lang: ex["translation"][lang] for lang in langs})
    for lang in langs:
        if lang not in ds.column_names:
            raise DataError(f"unknown language code {lang!r} for {cfg.hub_name}: columns are {ds.column_names}")
    pair = lambda ex, src, tgt: {"src": ex[src].strip(), "tgt": ex[tgt].strip()}  # noqa: E731
    return [ds.map(pair, fn_kwargs={"src": s, "tgt": cfg.tgt_lang}, remove_columns=ds.column_names) for s in src_langs]


# --- Token ids ----------------------------------------------------------------------------------


@dataclass
class TokenizedCorpus:
    """Token ids of one split (no BOS/EOS yet), aligned with the raw text."""

    src: list[list[int]]
    tgt: list[list[int]]
    src_text: list[str]
    tgt_text: list[str]

    def __len__(self) -> int:
        return len(self.src)

    def lengths(self) -> np.ndarray:
        """Padded length of each pair in a batch: the longer side plus its BOS/EOS."""
        return np.array([max(len(s), len(t)) + 1 for s, t in zip(self.src, self.tgt)], dtype=np.int64)

    def pairs(self, indices) -> tuple[list[list[int]], list[list[int]]]:
        """The source and target ids of the pairs at `indices`."""
        return [self.src[i] for i in indices], [self.tgt[i] for i in indices]


class MappedCorpus:
    """Token ids of a training split in memory-mapped Arrow files (data.streaming=true): the
    lengths live in memory (one integer per pair), the ids are read a batch at a time."""

    def __init__(self, ds: datasets.Dataset):
        self.ds = ds  # columns src_ids, tgt_ids, length

    def __len__(self) -> int:
        return len(self.ds)

    def lengths(self) -> np.ndarray:
        return self.ds.select_columns(["length"]).with_format("numpy")[:]["length"].astype(np.int64)

    def pairs(self, indices) -> tuple[list[list[int]], list[list[int]]]:
        rows = self.ds[[int(i) for i in indices]]
        return rows["src_ids"], rows["tgt_ids"]


def tokenize_mapped(ds: datasets.Dataset, tokenizer) -> MappedCorpus:
    """Tokenize an Arrow-backed split into new Arrow files (text stripped, as read_lines does)."""

    def encode(batch):
        src = tokenizer.source.encode([t.strip() for t in batch["src"]])
        tgt = tokenizer.encode([t.strip() for t in batch["tgt"]])
        return {"src_ids": src, "tgt_ids": tgt, "length": [max(len(s), len(t)) + 1 for s, t in zip(src, tgt)]}

    return MappedCorpus(ds.map(encode, batched=True, batch_size=10_000, remove_columns=ds.column_names))


def training_text(ds: datasets.Dataset, columns=("src", "tgt")) -> Iterable[str]:
    """The sides of a split in `columns`, batch by batch, for SentencePiece (which samples
    data.spm_sample)."""
    for batch in ds.iter(batch_size=10_000):
        for column in columns:
            yield from (t.strip() for t in batch[column])


def tokenize(ds: datasets.Dataset, tokenizer) -> TokenizedCorpus:
    ids = ds.map(
        lambda batch: {"src_ids": tokenizer.source.encode(batch["src"]), "tgt_ids": tokenizer.encode(batch["tgt"])},
        batched=True,
        batch_size=2048,
    )
    columns = ids.to_dict()
    return TokenizedCorpus(columns["src_ids"], columns["tgt_ids"], columns["src"], columns["tgt"])


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


def filter_long(corpus: TokenizedCorpus | MappedCorpus, max_len: int) -> TokenizedCorpus | MappedCorpus:
    if isinstance(corpus, MappedCorpus):
        kept = MappedCorpus(corpus.ds.filter(lambda n: [x <= max_len for x in n], input_columns="length", batched=True))
        if len(kept) < len(corpus):
            log.info("dropped %d of %d training pairs longer than %d tokens", len(corpus) - len(kept), len(corpus), max_len)  # fmt: skip
        return kept
    keep = [i for i, (s, t) in enumerate(zip(corpus.src, corpus.tgt)) if max(len(s), len(t)) + 1 <= max_len]
    if len(keep) < len(corpus):
        log.info("dropped %d of %d training pairs longer than %d tokens", len(corpus) - len(keep), len(corpus), max_len)
    pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
    return TokenizedCorpus(pick(corpus.src), pick(corpus.tgt), pick(corpus.src_text), pick(corpus.tgt_text))


class SubwordSampler:
    """Subword regularization (Kudo, 2018) with the unigram model's n-best segmentations: each
    epoch, each sentence takes one of its data.subword_nbest best segmentations, with probability
    proportional to P(segmentation) ** data.subword_alpha (small alpha: closer to uniform, more
    variety). The draw comes from a numpy generator, so a (seed, epoch) always gives the same ids,
    across processes and on resume. A pair whose drawn ids outgrow data.max_len keeps its usual
    segmentation."""

    def __init__(self, corpus: TokenizedCorpus, tokenizer, cfg: DataConfig, chunk: int = 10_000):
        self.corpus, self.max_len = corpus, cfg.max_len
        ids, piece_scores, alt_lengths, alt_counts = [], [], [], []
        for texts, side in ((corpus.src_text, tokenizer.source), (corpus.tgt_text, tokenizer)):
            scores = side.piece_scores()
            for start in range(0, len(texts), chunk):  # n-best lists as flat arrays: lists of lists would take GBs
                for alternatives in side.nbest(texts[start : start + chunk], cfg.subword_nbest):
                    alt_counts.append(len(alternatives))
                    alt_lengths.extend(len(a) for a in alternatives)
                    ids.append(np.fromiter((i for a in alternatives for i in a), dtype=np.int32))
                    piece_scores.append(scores[ids[-1]])
        self.ids = np.concatenate(ids)
        # Alternative k is ids[alt_start[k]:alt_start[k + 1]]; sentence j owns alternatives
        # first_alt[j] to first_alt[j + 1] - 1 (sources first, then targets).
        self.alt_start = np.concatenate([[0], np.cumsum(alt_lengths)])
        self.first_alt = np.concatenate([[0], np.cumsum(alt_counts)])
        scores = np.concatenate(piece_scores)  # each id's log-probability in its side's model
        log_prob = np.add.reduceat(scores, self.alt_start[:-1]) if len(self.ids) else np.zeros(0)
        self.logits = cfg.subword_alpha * log_prob
        self.sentence_of_alt = np.repeat(np.arange(len(alt_counts)), alt_counts)

    def draw(self, rng: np.random.Generator) -> TokenizedCorpus:
        """One segmentation of the corpus: per sentence, the Gumbel-max choice among its alternatives."""
        keys = self.logits + rng.gumbel(size=len(self.logits))
        order = np.lexsort((-keys, self.sentence_of_alt))  # per sentence, the largest key first
        chosen = order[self.first_alt[:-1]]
        seqs = [self.ids[self.alt_start[k] : self.alt_start[k + 1]].tolist() for k in chosen]
        n = len(self.corpus)
        src, tgt = seqs[:n], seqs[n:]
        for i in range(n):
            if max(len(src[i]), len(tgt[i])) + 1 > self.max_len:
                src[i], tgt[i] = self.corpus.src[i], self.corpus.tgt[i]
        return TokenizedCorpus(src, tgt, self.corpus.src_text, self.corpus.tgt_text)


# --- Batches ------------------------------------------------------------------------------------


def token_batches(lengths: np.ndarray, max_tokens: int, rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Group sentence indices so each batch pads to at most max_tokens tokens.

    Sorting by length keeps padding low; `rng` breaks ties among equal lengths and shuffles the
    order of the batches (pass None for a fixed order, as in evaluation).
    """
    tiebreak = rng.random(len(lengths)) if rng is not None else np.arange(len(lengths))
    order = np.lexsort((tiebreak, lengths))
    batches, start = [], 0
    while start < len(order):
        end = start + 1  # a single over-long sentence still forms a batch of its own
        while end < len(order) and (end - start + 1) * lengths[order[end]] <= max_tokens:
            end += 1
        batches.append(order[start:end])
        start = end
    if rng is not None:
        rng.shuffle(batches)
    return batches


@dataclass
class Batch:
    src: Tensor  # (batch, src_len): tokens + EOS, right-padded
    tgt_in: Tensor  # (batch, tgt_len): BOS + tokens, the decoder input
    tgt_out: Tensor  # (batch, tgt_len): tokens + EOS, what the decoder must predict
    indices: np.ndarray  # positions of these pairs in their corpus
    n_src_tokens: int  # non-padding tokens, counted on the host so no device sync is needed
    n_tgt_tokens: int

    def to(self, device: torch.device) -> Batch:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Batch(
            move(self.src), move(self.tgt_in), move(self.tgt_out), self.indices, self.n_src_tokens, self.n_tgt_tokens
        )


def pad(sequences: list[list[int]], pad_id: int) -> Tensor:
    out = torch.full((len(sequences), max(len(s) for s in sequences)), pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def collate(corpus: TokenizedCorpus | MappedCorpus, indices: np.ndarray, tokenizer) -> Batch:
    bos, eos, pad_id = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
    sources, targets = corpus.pairs(indices)
    src = pad([s + [eos] for s in sources], pad_id)
    tgt_in = pad([[bos] + t for t in targets], pad_id)
    tgt_out = pad([t + [eos] for t in targets], pad_id)
    n_src, n_tgt = sum(len(s) + 1 for s in sources), sum(len(t) + 1 for t in targets)
    return Batch(src, tgt_in, tgt_out, indices, n_src, n_tgt)
