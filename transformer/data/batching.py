"""Token ids of a corpus and the padded batches made of them: a split tokenized in memory
(`TokenizedCorpus`) or into memory-mapped Arrow files (`MappedCorpus`), subword sampling, and
batches grouped by padded token count."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from .corpus import DataConfig, DataError

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)


# --- Token ids ----------------------------------------------------------------------------------


@dataclass
class TokenizedCorpus:
    """Token ids of one split (no BOS/EOS yet; a many-to-many model's sources start with their
    target tag), aligned with the raw text; `direction` names each pair's direction ("de-en") in a
    split of several, and is None in a split of one."""

    src: list[list[int]]
    tgt: list[list[int]]
    src_text: list[str]
    tgt_text: list[str]
    direction: list[str] | None = None

    def directions(self) -> dict[str, list[int]]:
        """{direction: the indices of its pairs}, in order of first appearance ({"": all} for a split of one)."""
        if self.direction is None:
            return {"": list(range(len(self)))}
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(self.direction):
            groups.setdefault(name, []).append(i)
        return groups

    def subset(self, indices) -> TokenizedCorpus:
        pick = lambda xs: None if xs is None else [xs[i] for i in indices]  # noqa: E731
        return TokenizedCorpus(
            pick(self.src), pick(self.tgt), pick(self.src_text), pick(self.tgt_text), pick(self.direction)
        )

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


def tokenize_mapped(ds: datasets.Dataset, tokenizer, tgt_lang: str | None = None) -> MappedCorpus:
    """Tokenize an Arrow-backed split into new Arrow files (text stripped, as read_lines does);
    with a tokenizer that has target tags, each source starts with `tgt_lang`'s (source_ids)."""

    def encode(batch):
        langs = None if tgt_lang is None else [tgt_lang] * len(batch["src"])
        src = source_ids(tokenizer, [t.strip() for t in batch["src"]], langs)
        tgt = tokenizer.encode([t.strip() for t in batch["tgt"]])
        return {"src_ids": src, "tgt_ids": tgt, "length": [max(len(s), len(t)) + 1 for s, t in zip(src, tgt)]}

    return MappedCorpus(ds.map(encode, batched=True, batch_size=10_000, remove_columns=ds.column_names))


def source_ids(tokenizer, texts: list[str], tgt_langs: list[str] | None) -> list[list[int]]:
    """Source token ids of `texts`; with a tokenizer that has target tags, each starts with the tag
    of its target language (tgt_langs, one per text)."""
    ids = tokenizer.source.encode(texts)
    tags = tokenizer.target_tags
    if not tags:
        return ids
    if tgt_langs is None:
        raise DataError("the tokenizer has target-language tags, but the split names no target language")
    for lang in set(tgt_langs) - set(tags):
        raise DataError(f"the tokenizer has no tag for target language {lang!r}; it has {', '.join(sorted(tags))}")
    return [[tags[lang], *sentence] for lang, sentence in zip(tgt_langs, ids)]


def tokenize(ds: datasets.Dataset, tokenizer, tgt_lang: str | None = None) -> TokenizedCorpus:
    """A split's token ids. With a tokenizer that has target tags, each source starts with the tag
    of its "tgt_lang" column, or of `tgt_lang` for a split without one."""
    multi = "tgt_lang" in ds.column_names

    def encode(batch):
        langs = batch["tgt_lang"] if multi else None if tgt_lang is None else [tgt_lang] * len(batch["src"])
        return {"src_ids": source_ids(tokenizer, batch["src"], langs), "tgt_ids": tokenizer.encode(batch["tgt"])}

    columns = ds.map(encode, batched=True, batch_size=2048).to_dict()
    direction = [f"{s}-{t}" for s, t in zip(columns["src_lang"], columns["tgt_lang"])] if multi else None
    return TokenizedCorpus(columns["src_ids"], columns["tgt_ids"], columns["src"], columns["tgt"], direction)


def filter_long(corpus: TokenizedCorpus | MappedCorpus, max_len: int) -> TokenizedCorpus | MappedCorpus:
    if isinstance(corpus, MappedCorpus):
        kept = MappedCorpus(corpus.ds.filter(lambda n: [x <= max_len for x in n], input_columns="length", batched=True))
        if len(kept) < len(corpus):
            log.info("dropped %d of %d training pairs longer than %d tokens", len(corpus) - len(kept), len(corpus), max_len)  # fmt: skip
        return kept
    keep = [i for i, (s, t) in enumerate(zip(corpus.src, corpus.tgt)) if max(len(s), len(t)) + 1 <= max_len]
    if len(keep) < len(corpus):
        log.info("dropped %d of %d training pairs longer than %d tokens", len(corpus) - len(keep), len(corpus), max_len)
    return corpus.subset(keep)


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
