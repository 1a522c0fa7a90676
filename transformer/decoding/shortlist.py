"""A lexical shortlist: the output layer restricted, sentence by sentence, to the target pieces its
source is likely to translate into (as Marian's lexical shortlist and CTranslate2's vocabulary map).

The shortlist lists, for each source piece, the `best` target pieces it most likely translates
into, and the `first` most frequent target pieces, which every sentence may use. Built from the
training pairs by IBM Model 1 (Brown et al. 1993): a few rounds of EM over p(target | source)
with every target piece of a pair explained by one of its source pieces or by none.

A sentence's candidates are the frequent pieces, its source pieces' translations, the special
tokens and whatever its target prefix or constraints ask for. `Shortlisted` is a decoding model
(the interface of decoding/__init__.py) whose logits outside a sentence's candidates are -inf:
the model's own decoder runs, and only the output projection is cut to the rows the batch's
sentences need. Greedy search, sampling and beam search then work on those columns alone
(processors.Columns), as CTranslate2 does with its map. Marian and CTranslate2 give every
sentence of a batch the union of the batch's candidates, so a translation there can change with
its batch-mates; here it cannot. The file is
CTranslate2's vocabulary map (`source piece TAB target pieces`, the empty key holding the
frequent pieces), so our decoder and the export read one list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..data.corpus import DataError
from ..errors import ConfigError

FILE_NAME = "shortlist.tsv"  # beside the checkpoint, read by Translator.load and copied by the export


def shortlist_path(checkpoint: Path) -> Path:
    """Where the shortlist of a checkpoint's run lives: one per run directory, since it depends on
    the training data and the tokenizer, not on the weights."""
    return Path(checkpoint).with_name(FILE_NAME)


@dataclass
class Shortlist:
    """fixed: (n,) target ids every batch may use; table: (source vocab, best) each source id's
    target ids, -1 where it has fewer."""

    fixed: Tensor
    table: Tensor

    @property
    def best(self) -> int:
        return self.table.size(1)

    def candidates(self, src: Tensor, vocab_size: int, always: Iterable[int] = (), extra: Tensor | None = None) -> Tensor:  # fmt: skip
        """Each sentence's target ids, sorted, one row each padded with vocab_size: src (batch,
        src_len) source ids -> (batch, most candidates). A sentence's are the frequent pieces, its
        source pieces' translations, `always` (the special tokens) and its row of `extra` (batch,
        n): its prefix's and its constraints' ids, negative entries ignored."""
        table = self.table[src.cpu()].flatten(1)  # (batch, src_len * best)
        parts = [table, self.fixed.expand(len(src), -1), torch.tensor(list(always), dtype=torch.long).expand(len(src), -1)]  # fmt: skip
        if extra is not None:
            parts.append(extra.cpu())
        ids = torch.cat(parts, dim=1)
        chosen = torch.zeros(len(ids), vocab_size + 1, dtype=torch.bool)  # the last column takes the negative ids
        chosen.scatter_(1, ids.masked_fill(ids < 0, vocab_size), True)
        chosen = chosen[:, :vocab_size]
        counts = chosen.sum(1)
        sentence, token = chosen.nonzero(as_tuple=True)  # row by row, each row's ids in order
        place = torch.arange(len(token)) - (counts.cumsum(0) - counts).repeat_interleave(counts)
        rows = torch.full((len(ids), int(counts.max())), vocab_size, dtype=torch.long)
        rows[sentence, place] = token
        return rows

    def save(self, path: Path, source_piece: Callable[[int], str], target_piece: Callable[[int], str]) -> None:
        """Write CTranslate2's vocabulary map: `source piece TAB its target pieces`, one line per
        source piece, the first line's empty key holding the frequent pieces."""
        lines = ["\t" + " ".join(target_piece(int(t)) for t in self.fixed)]
        for s, row in enumerate(self.table.tolist()):
            targets = [target_piece(t) for t in row if t >= 0]
            if targets:
                lines.append(f"{source_piece(s)}\t{' '.join(targets)}")
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path, tokenizer) -> Shortlist:
        """Read a vocabulary map written by `save` for this tokenizer's pieces; a line that is not
        `piece TAB pieces`, or a piece the model does not know, stops with its line number."""
        source, fixed, rows = tokenizer.source, [], {}
        for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            key, tab, values = line.partition("\t")
            if not tab:
                raise DataError(f"{path}, line {number}: not `source piece<TAB>target pieces`")
            targets = [known(tokenizer, piece, path, number) for piece in values.split()]
            if key == "":
                fixed.extend(targets)
            else:
                rows[known(source, key, path, number)] = targets
        best = max((len(t) for t in rows.values()), default=0)
        table = torch.full((len(source), max(best, 1)), -1, dtype=torch.long)
        for s, targets in rows.items():
            table[s, : len(targets)] = torch.tensor(targets, dtype=torch.long)
        return cls(torch.tensor(sorted(set(fixed)), dtype=torch.long), table)


def known(tokenizer, piece: str, path: Path, number: int) -> int:
    """The id of `piece`, which the tokenizer must know (a shortlist built for another model does not)."""
    i = tokenizer.piece_to_id(piece)
    if tokenizer.id_to_piece(i) != piece:
        raise DataError(f"{path}, line {number}: piece {piece!r} is not in the model's vocabulary (built for another model?)")  # fmt: skip
    return i


def build(
    sources: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    src_vocab: int,
    tgt_vocab: int,
    first: int = 100,
    best: int = 50,
    rounds: int = 5,
    skip: Iterable[int] = (),
) -> Shortlist:
    """A shortlist from tokenized training pairs: the `first` most frequent target ids and, for
    each source id, its `best` target ids by IBM Model 1's p(target | source) after `rounds` of
    EM. Ids in `skip` (the special tokens, target tags) are left out of both sides."""
    skip = set(skip)
    null = src_vocab  # the source "piece" a target piece is explained by when no real one is
    src_ids, tgt_ids, groups = [], [], []
    group = 0
    for s, t in zip(sources, targets):
        s = np.array([i for i in s if i not in skip] + [null], dtype=np.int64)
        t = np.array([i for i in t if i not in skip], dtype=np.int64)
        if len(t) == 0:
            continue
        src_ids.append(np.tile(s, len(t)))  # every (target position, source piece) of the pair
        tgt_ids.append(np.repeat(t, len(s)))
        groups.append(np.repeat(np.arange(group, group + len(t)), len(s)))
        group += len(t)
    if not src_ids:
        raise DataError("no training pair has a target piece to build a shortlist from")
    src, tgt, grp = (torch.from_numpy(np.concatenate(a)) for a in (src_ids, tgt_ids, groups))
    keys, link = torch.unique(src * tgt_vocab + tgt, return_inverse=True)  # one (source, target) entry each
    key_src, key_tgt = keys // tgt_vocab, keys % tgt_vocab
    prob = torch.full((len(keys),), 1.0 / tgt_vocab, dtype=torch.float64)  # p(t | s), uniform at first
    for _ in range(rounds):
        p = prob[link]
        per_target = torch.zeros(group, dtype=torch.float64).index_add_(0, grp, p)
        counts = torch.zeros(len(keys), dtype=torch.float64).index_add_(0, link, p / per_target[grp])
        totals = torch.zeros(src_vocab + 1, dtype=torch.float64).index_add_(0, key_src, counts)
        prob = counts / totals[key_src]
    frequency = torch.bincount(torch.from_numpy(np.concatenate([np.unique(t) for t in tgt_ids])), minlength=tgt_vocab)
    fixed = frequency.topk(min(first, int((frequency > 0).sum()))).indices.sort().values
    table = torch.full((src_vocab, best), -1, dtype=torch.long)
    order = torch.argsort(key_src * 2.0 - prob, stable=True)  # by source id, then most probable first
    key_src, key_tgt = key_src[order], key_tgt[order]
    starts = torch.searchsorted(key_src, torch.arange(src_vocab + 1))
    for s in range(src_vocab):
        row = key_tgt[starts[s] : starts[s + 1]][:best]
        table[s, : len(row)] = row
    return Shortlist(fixed, table)


def build_for(tokenizer, sources: list[str], targets: list[str], first: int = 100, best: int = 50, rounds: int = 5) -> Shortlist:  # fmt: skip
    """`build` on parallel text with `tokenizer`'s pieces, its special tokens and target tags left out
    (scripts/build_shortlist.py and distill.py's shortlist stage)."""
    specials = {tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id, *tokenizer.target_tags.values()}  # fmt: skip
    return build(tokenizer.source.encode(sources), tokenizer.encode(targets), len(tokenizer.source), len(tokenizer), first, best, rounds, specials)  # fmt: skip


class ShortlistModel:
    """A decoding model (a Transformer or an ensemble) with a shortlist: decode_batch narrows it to
    each batch's sentences' candidates (`for_batch`); decoded as a whole it is the model itself."""

    def __init__(self, model, shortlist: Shortlist, always: Iterable[int]):
        self.model, self.cfg, self.shortlist, self.always = model, model.cfg, shortlist, tuple(always)
        for member in getattr(model, "models", [model]):
            if member.output is not None and not hasattr(member.output, "weight"):
                raise ConfigError("decode.shortlist needs the output layer's weights: an int8 untied output layer has none")  # fmt: skip

    def eval(self) -> ShortlistModel:
        self.model.eval()
        return self

    def encode(self, src: Tensor, src_mask: Tensor):
        return self.model.encode(src, src_mask)

    def new_state(self):
        return self.model.new_state()

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor, state=None):
        return self.model.decode(tgt, memory, src_mask, state)

    def for_batch(self, src: Tensor, extra: Tensor | None = None, narrow: bool = True):
        """The model restricted, sentence by sentence, to the candidates of the sources src
        (batch, src_len) and of their prefixes and constraints `extra` (batch, n). narrow: its
        logits have a column per candidate of the batch (`columns`), for the searches that read
        processors.Columns (greedy, sampling, beam); else a column per vocabulary token."""
        candidates = self.shortlist.candidates(src, self.cfg.vocab_size, self.always, extra).to(src.device)
        members = getattr(self.model, "models", None)
        if members is None:
            return Shortlisted(self.model, candidates, narrow)
        return type(self.model)([Shortlisted(m, candidates, narrow) for m in members])


@dataclass
class ShortlistState:
    """The model's decoding state, and which input sentence each sentence still decoded is."""

    state: object
    live: Tensor  # (sentences still in the batch,) their numbers in the batch as it began

    def reorder(self, index: Tensor, sources: Tensor | None = None) -> None:
        self.state.reorder(index, sources)
        self.live = self.live[(index if sources is None else sources).to(self.live.device)]

    def reorder_targets(self, index: Tensor) -> None:
        self.state.reorder_targets(index)


class Shortlisted:
    """A decoding model whose next-token logits outside each sentence's candidates are -inf, so a
    sentence's translation does not depend on the sentences batched with it. The model decodes
    as always; its output projection runs only the rows of the output weight that some sentence
    of the batch has among its candidates, and each row's logits outside its own sentence's are
    then ruled out. candidates: (sentences, n) ids, padded with vocab_size.

    narrow: the logits are the union's columns alone, (rows, len, u), and `columns` says which
    token each is (processors.Columns), so the search's softmax, arg-max and top-k read u columns
    instead of the vocabulary; otherwise they are written into full rows of -inf (for searches
    that index the vocabulary themselves: constrained beam search)."""

    def __init__(self, model, candidates: Tensor, narrow: bool = False):
        self.model, self.cfg = model, model.cfg
        vocab = self.cfg.vocab_size
        union = candidates.unique()
        self.union = union[union < vocab]  # (u,) sorted
        self.columns = self.union if narrow else None
        self.project = model.vocabulary_projection(self.union)  # (rows, len, d_model) -> (rows, len, u)
        place = torch.searchsorted(self.union, candidates).masked_fill(candidates >= vocab, len(self.union))
        allowed = torch.zeros(len(candidates), len(self.union) + 1, dtype=torch.bool, device=candidates.device)
        self.ruled_out = ~allowed.scatter_(1, place, True)[:, :-1]  # (sentences, u)
        self.mask, self.mask_of = None, None  # (live sentences, 1, u): 0 or -inf, for the live sentences `mask_of`
        self.full = None  # the logits decode returns, reused from step to step (callers read them, never write)

    def eval(self) -> Shortlisted:
        self.model.eval()
        return self

    def encode(self, src: Tensor, src_mask: Tensor):
        return self.model.encode(src, src_mask)

    def new_state(self) -> ShortlistState:
        return ShortlistState(self.model.new_state(), torch.arange(len(self.ruled_out), device=self.union.device))

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor, state: ShortlistState, need_weights: bool = False):
        hidden, weights = self.model.decode(tgt, memory, src_mask, state.state, need_weights, project=False)
        rows, sentences = hidden.size(0), len(state.live)  # each sentence's rows are consecutive (its beams)
        if rows % sentences:
            raise ValueError(f"{rows} rows do not divide into {sentences} sentences")
        logits = self.project(hidden)  # (rows, len, u)
        if self.mask_of is not state.live:  # the live sentences changed: their masks, once
            ruled_out = self.ruled_out[state.live][:, None]
            self.mask = logits.new_zeros(ruled_out.shape).masked_fill_(ruled_out, -math.inf)
            self.mask_of = state.live
        logits.view(sentences, -1, logits.size(-1)).add_(self.mask)  # each row's sentence's
        if self.columns is not None:
            return logits, weights
        shape = (*logits.shape[:-1], self.cfg.vocab_size)
        if self.full is None or self.full.dtype != logits.dtype or self.full.numel() < math.prod(shape):
            self.full = logits.new_full((math.prod(shape),), -math.inf)  # written at the union's columns only
        full = self.full[: math.prod(shape)].view(shape)  # the first rows: the columns outside stay -inf
        return full.index_copy_(-1, self.union, logits), weights
