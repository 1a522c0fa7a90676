"""Beam search, batched over sentences x beams with GNMT length normalization, and the tensor
operations of one step apart from the search itself: the best one-token extensions of every beam
(`best_extensions`), and an order of the surviving beams that copies as few key/value caches as
possible (`stay_in_place`)."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..model import padding_mask
from .processors import Columns, length_penalty, log_probs, max_lengths, sentence_done, source_lengths
from .search import Hypothesis, select, worth_pruning

if TYPE_CHECKING:
    from .config import DecodeConfig


@torch.no_grad()
def beam_search(
    model, src: Tensor, bos_id: int, eos_id: int, cfg: DecodeConfig, prefix: Tensor | None = None
) -> list[list[Hypothesis]]:
    """Batched beam search over sentences x beams with GNMT length normalization; every hypothesis
    of a sentence starts with its target prefix (batch, prefix_len; -1 after its end) if given.
    Returns, per sentence, the n_best finished hypotheses sorted by score.

    Each step scores every (beam, token) extension, keeps hypotheses that end in EOS among the
    best k as finished, and continues with the best k that do not. A sentence is done once no live
    beam can beat the n_best-th of its finished hypotheses: later ones would rank below them.

    The bookkeeping of finished hypotheses reads host copies made once per step (`host_max_len`
    once per batch): on a GPU, reading one element per sentence per step idled the device.
    """
    k, batch, pad_id = cfg.beam_size, src.size(0), model.cfg.pad_id
    src_mask = padding_mask(src, pad_id)
    max_len = max_lengths(source_lengths(src_mask), cfg, model.cfg.max_positions - 1, prefix)  # (batch,)
    host_max_len = max_len.cpu()
    memory, _ = model.encode(src, src_mask)
    state = model.new_state()
    columns, eos_column, pad_column, prefix = Columns.for_search(model, eos_id, pad_id, prefix)
    # All k beams of a sentence would start identical, so the first step expands one row per
    # sentence (unless the vocabulary, or the candidates, are too few to give 2k extensions); later steps have k.
    width = 1 if columns.count(model.cfg.vocab_size) >= 2 * k else k
    tokens = torch.full((batch * width, 1), bos_id, dtype=torch.long, device=src.device)
    scores = torch.full((batch, width), -math.inf, device=src.device)  # log-probability of each live beam
    scores[:, 0] = 0.0  # with k rows at the first step, only the first one expands
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    sentence = list(range(batch))  # the input sentence of each sentence still in the batch
    done = torch.zeros(batch, dtype=torch.bool)
    for step in range(int(host_max_len.max())):
        logits, _ = model.decode(tokens[:, -1:], memory, src_mask, state)
        forcing = bool((step + 1 >= host_max_len).any())
        prefixes = prefix.repeat_interleave(width, dim=0) if prefix is not None and step < prefix.size(1) else None
        lprobs = log_probs(logits[:, -1], step, max_len.repeat_interleave(width), eos_column, pad_column, cfg.min_len, prefixes, forcing=forcing)  # fmt: skip
        vocab = lprobs.size(-1)
        top, index = best_extensions(scores, lprobs, 2 * k)  # (sentences, 2k)
        beam, token = index // vocab, columns.tokens(index % vocab)
        ends = (token == eos_id) & top.isfinite()
        present = [finished[i] for i in sentence]
        add_finished(present, done, top, beam, ends, tokens, width, cfg)
        scores, beam, token = survivors(top, beam, token, ends, k)
        done |= search_done(present, scores.cpu(), host_max_len, step, cfg.n_best, cfg.length_penalty)
        if done.all():
            break
        rows = torch.arange(len(sentence), device=src.device)[:, None] * width + beam  # (sentences, k)
        width = k
        if worth_pruning(int(done.sum()), len(sentence)):  # finished sentences leave the batch
            live = (~done).nonzero().flatten()
            sentence, done, host_max_len = [sentence[i] for i in live.tolist()], done[live], host_max_len[live]
            live = live.to(src.device)
            rows, scores, token, max_len = rows[live].view(-1), scores[live], token[live], max_len[live]
            prefix = None if prefix is None else prefix[live]
            memory, src_mask = select(memory, live), src_mask[live]  # one row per sentence, see cross_attend
            state.reorder(rows, sources=live)
        else:
            rows = rows.view(-1)
            state.reorder_targets(rows)  # beams move within their sentence
        tokens = torch.cat([tokens[rows], token.view(-1, 1)], dim=1)
    return [sorted(f, key=lambda h: -h.score)[: cfg.n_best] for f in finished]


def survivors(top: Tensor, beam: Tensor, token: Tensor, ends: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The best k of a step's candidates (sentences, 2k) that do not end in EOS (a stable sort
    keeps their order), placed in slots that spare cache copies (`stay_in_place`): their scores,
    parent beams and tokens, each (sentences, k)."""
    keep = torch.sort(ends.to(torch.int8), dim=1, stable=True).indices[:, :k]
    scores, beam, token = top.gather(1, keep), beam.gather(1, keep), token.gather(1, keep)
    order = stay_in_place(beam)
    return scores.gather(1, order), beam.gather(1, order), token.gather(1, order)


def add_finished(finished, done, top, beam, ends, tokens, width: int, cfg: DecodeConfig) -> None:
    """Record candidates ranked among the best k that end in EOS (sentences not yet done);
    tokens holds `width` rows per sentence."""
    k = cfg.beam_size
    length = tokens.size(1)  # generated tokens so far + BOS = this hypothesis' length with its EOS
    penalty = length_penalty(length, cfg.length_penalty)
    found = [(sent, rank) for sent, rank in ends[:, :k].cpu().nonzero().tolist() if not done[sent]]
    if not found:  # the scores and parents are copied to the host only when a hypothesis ended
        return
    top, beam = top[:, :k].cpu().tolist(), beam[:, :k].cpu().tolist()
    rows = torch.tensor([sent * width + beam[sent][rank] for sent, rank in found], device=tokens.device)
    for (sent, rank), ids in zip(found, tokens[rows, 1:].tolist()):  # one copy of all their tokens
        log_prob = top[sent][rank]
        finished[sent].append(Hypothesis(ids, log_prob / penalty, log_prob))


def search_done(finished, scores: Tensor, max_len: Tensor, step: int, n_best: int, alpha: float) -> Tensor:
    """(batch,) `sentence_done` for each sentence: finished hypotheses per sentence, scores
    (batch, k) of its live beams, max_len (batch,)."""
    done = torch.zeros(len(finished), dtype=torch.bool)
    for sent, hyps in enumerate(finished):
        done[sent] = sentence_done(hyps, float(scores[sent].max()), int(max_len[sent]), step, n_best, alpha)
    return done


def best_extensions(scores: Tensor, lprobs: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The `count` best one-token extensions of each sentence's beams: scores (sentences, width)
    and lprobs (sentences * width, vocab) -> their scores and indices (beam * vocab + token),
    each (sentences, count), sorted best first.

    The same as the top `count` of scores + lprobs over each sentence's width * vocab entries,
    without writing out that sum: the rows are cut into chunks, and the best `count` entries lie
    in the `count` chunks with the highest maxima (a chunk holding one of them has a maximum at
    least as high, and at most count - 1 other chunks can have a higher one). So one pass finds
    the chunk maxima and only those chunks are read again."""
    n, width = scores.shape
    vocab = lprobs.size(1)
    chunk = chunk_size(vocab)
    if chunk is None or width * vocab <= 4 * count * chunk:  # no chunk size fits, or little to skip
        return (scores.view(-1, 1) + lprobs).view(n, -1).topk(count, dim=1)
    per_row = vocab // chunk
    chunks = lprobs.view(n * width, per_row, chunk)
    maxima = (chunks.amax(-1) + scores.view(-1, 1)).view(n, width * per_row)
    best = maxima.topk(count, dim=1).indices  # (n, count): chunk numbers within each sentence
    beam = best // per_row
    rows = torch.arange(n, device=lprobs.device)[:, None] * width + beam
    values = chunks[rows, best % per_row] + scores.gather(1, beam)[..., None]  # (n, count, chunk)
    top, where = values.view(n, -1).topk(count, dim=1)
    return top, best.gather(1, where // chunk) * chunk + where % chunk


@functools.cache
def chunk_size(vocab: int) -> int | None:
    """The largest divisor of the vocabulary size from 16 to 256 (None if there is none): the
    chunk `best_extensions` cuts rows into. Cached, since every beam-search step asks."""
    return next((c for c in range(256, 15, -1) if vocab % c == 0), None)


def stay_in_place(parents: Tensor) -> Tensor:
    """An order for each sentence's k surviving beams that puts a survivor in its parent's slot
    where it can: (sentences, k) parent slots -> (sentences, k) indices to gather survivors by.

    Beam search depends on the set of beams, not their order, and a beam that stays in its
    parent's slot needs no copy of its key/value cache (see GrowingCache.reorder). The first
    survivor of each parent takes the parent's slot; the others fill the free slots in order.
    """
    n, k = parents.shape
    slots = torch.arange(k, device=parents.device)
    earlier = torch.ones(k, k, dtype=torch.bool, device=parents.device).tril(-1)  # [j, i]: i before j
    first = ~((parents[:, :, None] == parents[:, None, :]) & earlier).any(-1)  # first survivor of its parent
    taken = (parents[:, :, None] == slots).any(1)  # slot s is some survivor's parent
    free = torch.sort(taken.to(torch.int8), dim=1, stable=True).indices  # the free slots first, ascending
    rank = ((~first).long().cumsum(1) - 1).clamp(min=0)  # position among the survivors that move
    slot = torch.where(first, parents, free.gather(1, rank))
    return torch.empty_like(slot).scatter_(1, slot, slots.expand(n, k))
