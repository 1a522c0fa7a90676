"""Decoding strategies: greedy, beam search and sampling.

All of them talk to the model through one incremental-state interface:

    memory, _ = model.encode(src, src_mask)              # once per sentence
    state = model.new_state()                            # what the decoder keeps between steps
    logits, _ = model.decode(new_tokens, memory, src_mask, state)
    state.reorder(rows)                                  # follow the surviving hypotheses

`Transformer` implements it with a key/value cache, `Uncached` by recomputing the whole prefix
(the reference the cache is tested and benchmarked against), `Ensemble` by averaging several
models' probabilities.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .beams import best_extensions, stay_in_place
from .data import TokenizedCorpus, pad, token_batches
from .devices import PRECISIONS, autocast_dtype
from .mbr import UTILITIES, WEIGHTS, rerank
from .model import padding_mask

log = logging.getLogger(__name__)
STRATEGIES = ("greedy", "beam", "sample")


@dataclass
class DecodeConfig:
    strategy: str = "beam"  # "greedy", "beam" or "sample"
    beam_size: int = 5
    n_best: int = 1  # hypotheses returned per sentence (beam search)
    length_penalty: float = 0.6  # GNMT's alpha: scores are divided by ((5 + length) / 6) ** alpha
    max_len_a: float = 1.2  # a translation of a source of n tokens has at most a * n + b tokens
    max_len_b: int = 10
    min_len: int = 0  # tokens generated before EOS may end a translation (0: no minimum)
    max_tokens: int = 8192  # source tokens per decoding batch
    temperature: float = 1.0  # sampling
    top_k: int = 0  # sampling: keep the k most probable tokens; 0 keeps all
    top_p: float = 1.0  # sampling: keep the smallest set of tokens with this much probability
    seed: int = 1  # sampling
    precision: str = "fp32"  # matrix products in fp32, or bf16/fp16 autocast; auto: bf16 on CPUs with bf16 matrix instructions and on GPUs
    mbr: str = "none"  # beam: rerank the beam_size finished hypotheses by expected chrf or bleu (mbr.py)
    mbr_weights: str = "model"  # mbr: weigh the pseudo-references by the model's probabilities, or uniform

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"decode.strategy={self.strategy!r} is not one of {STRATEGIES}")
        self.check_ranges()
        if not 1 <= self.n_best <= self.beam_size:
            raise ValueError(f"decode.n_best={self.n_best} must be between 1 and decode.beam_size={self.beam_size}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"decode.precision={self.precision!r} is not one of {PRECISIONS}")
        if self.mbr not in UTILITIES or self.mbr_weights not in WEIGHTS:
            raise ValueError(f"decode.mbr must be one of {UTILITIES} and decode.mbr_weights one of {WEIGHTS}")
        if self.mbr != "none" and self.strategy != "beam":
            raise ValueError(f"decode.mbr={self.mbr} reranks beam search's hypotheses: it needs decode.strategy=beam")

    def check_ranges(self) -> None:
        for key, low in (("beam_size", 1), ("max_tokens", 1), ("max_len_b", 0), ("min_len", 0), ("top_k", 0)):
            if getattr(self, key) < low:
                raise ValueError(f"decode.{key}={getattr(self, key)} must be >= {low}")
        for key in ("max_len_a", "length_penalty"):  # search_done needs a penalty that grows with length
            if not 0 <= getattr(self, key) < math.inf:
                raise ValueError(f"decode.{key}={getattr(self, key)} must be >= 0 and finite")
        if self.max_len_a == 0 and self.max_len_b < 2:  # the limit counts the EOS
            raise ValueError(f"decode.max_len_b={self.max_len_b} with decode.max_len_a=0 leaves no room for a token")
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"decode.temperature={self.temperature} must be > 0 and finite")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"decode.top_p={self.top_p} is not in (0, 1]")

    def greedy(self) -> DecodeConfig:
        """These settings with greedy search (and no MBR, which needs a beam)."""
        return dataclasses.replace(self, strategy="greedy", mbr="none")

    @property
    def label(self) -> str:
        """A short name for file names and reports: greedy, beam5, beam5-mbr-chrf, sample."""
        if self.strategy != "beam":
            return self.strategy
        return f"beam{self.beam_size}" + (f"-mbr-{self.mbr}" if self.mbr != "none" else "")


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS and EOS
    score: float  # log-probability divided by the length penalty (the ranking score)
    log_prob: float


def max_lengths(src_mask: Tensor, cfg: DecodeConfig, limit: int) -> Tensor:
    """(batch,) maximum number of generated tokens per sentence, EOS included."""
    src_lens = src_mask.flatten(1).sum(-1)
    return (src_lens * cfg.max_len_a + cfg.max_len_b).long().clamp(min=1, max=limit)


def length_penalty(length: Tensor | int, alpha: float):
    """GNMT (Wu et al., 2016): lp(Y) = ((5 + |Y|) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


# --- Greedy and sampling: one token per sentence per step ---------------------------------------


def select(memory, rows: Tensor):
    """The encoder output of the batch rows `rows` (a tensor, or a list for ensembles)."""
    if isinstance(memory, Tensor):
        return memory.index_select(0, rows)
    return [select(m, rows) for m in memory]


def worth_pruning(n_done: int, n_rows: int) -> bool:
    """Whether to drop finished sentences from the batch now. Dropping copies every cache, so it
    waits until a quarter of the rows are finished: at most a few dozen copies per batch."""
    return n_done > 0 and 4 * n_done >= n_rows


@torch.no_grad()
def generate(model, src: Tensor, bos_id: int, eos_id: int, cfg: DecodeConfig, choose: Callable) -> list[Hypothesis]:
    """Extend each sentence by `choose(log_probs)` until EOS or its maximum length.

    Finished sentences leave the batch (see `worth_pruning`), so later steps only pay for the
    sentences still being translated."""
    src_mask = padding_mask(src, model.cfg.pad_id)
    memory, _ = model.encode(src, src_mask)
    max_len = max_lengths(src_mask, cfg, model.cfg.max_positions - 1)
    tokens = torch.full((src.size(0), 1), bos_id, dtype=torch.long, device=src.device)
    log_prob = torch.zeros(src.size(0), device=src.device)
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    sentence = torch.arange(src.size(0), device=src.device)  # the input sentence of each row
    out: list[Hypothesis] = [Hypothesis([], 0.0, 0.0)] * src.size(0)
    state = model.new_state()
    for step in range(int(max_len.max())):
        logits, _ = model.decode(tokens[:, -1:], memory, src_mask, state)
        lprobs = F.log_softmax(logits[:, -1].float(), dim=-1)  # (rows, vocab)
        if step < cfg.min_len:
            lprobs[:, eos_id] = -math.inf
        next_token = torch.where(step + 1 >= max_len, eos_id, choose(lprobs))  # out of room: end here
        next_token = torch.where(done, model.cfg.pad_id, next_token)
        log_prob += torch.where(done, 0.0, lprobs.gather(1, next_token[:, None]).squeeze(1))
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        done |= next_token == eos_id
        n_done = int(done.sum())
        if n_done == done.numel() or worth_pruning(n_done, done.numel()):
            ended = done.nonzero().flatten()  # copied to the host together, not row by row
            for i, lp, ids in zip(sentence[ended].tolist(), log_prob[ended].tolist(), tokens[ended, 1:].tolist()):
                out[i] = Hypothesis(strip_special(ids, eos_id), lp, lp)
            if n_done == done.numel():
                break
            rows = (~done).nonzero().flatten()
            tokens, log_prob, max_len, sentence = tokens[rows], log_prob[rows], max_len[rows], sentence[rows]
            memory, src_mask, done = select(memory, rows), src_mask[rows], done[rows]
            state.reorder(rows)
    return out  # the last step ends every sentence: max_len forces EOS


def argmax(lprobs: Tensor) -> Tensor:
    """The greedy choice: the most probable token of each row."""
    return lprobs.argmax(-1)


def greedy(model, src: Tensor, bos_id: int, eos_id: int, cfg: DecodeConfig) -> list[list[int]]:
    """The most probable next token at every step. src: (batch, src_len) -> token ids, no BOS/EOS."""
    return [h.tokens for h in generate(model, src, bos_id, eos_id, cfg, argmax)]


def sampler(cfg: DecodeConfig, generator: torch.Generator) -> Callable[[Tensor], Tensor]:
    """Draw the next token from the temperature-scaled distribution, cut to top-k and top-p."""

    def choose(lprobs: Tensor) -> Tensor:
        logits = lprobs / cfg.temperature
        if cfg.top_k:
            kth = logits.topk(min(cfg.top_k, logits.size(-1)), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if cfg.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            mass_before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)
            drop = (mass_before >= cfg.top_p).scatter(-1, order, mass_before >= cfg.top_p)
            logits = logits.masked_fill(drop, -math.inf)
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)

    return choose


# --- Beam search --------------------------------------------------------------------------------


@torch.no_grad()
def beam_search(model, src: Tensor, bos_id: int, eos_id: int, cfg: DecodeConfig) -> list[list[Hypothesis]]:
    """Batched beam search over sentences x beams with GNMT length normalization.

    Each step scores every (beam, token) extension, keeps hypotheses that end in EOS among the
    best k as finished, and continues with the best k that do not. A sentence is done once it
    has k finished hypotheses and no live beam can still beat the worst of them.
    Returns, per sentence, the n_best finished hypotheses sorted by score.

    The bookkeeping of finished hypotheses runs on the host, on host copies made once per step
    (`host_max_len` once per batch): on a GPU each read of a single element would wait for the
    device, and with one such wait per sentence per step the GPU idled between them.
    """
    k, batch, pad_id = cfg.beam_size, src.size(0), model.cfg.pad_id
    src_mask = padding_mask(src, pad_id)
    max_len = max_lengths(src_mask, cfg, model.cfg.max_positions - 1)  # (batch,)
    host_max_len = max_len.cpu()
    memory, _ = model.encode(src, src_mask)
    state = model.new_state()
    # All k beams of a sentence would start identical, so the first step expands one row per
    # sentence (unless the vocabulary is too small to give 2k candidates); later steps have k.
    width = 1 if model.cfg.vocab_size >= 2 * k else k
    tokens = torch.full((batch * width, 1), bos_id, dtype=torch.long, device=src.device)
    scores = torch.full((batch, width), -math.inf, device=src.device)  # log-probability of each live beam
    scores[:, 0] = 0.0  # with k rows at the first step, only the first one expands
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    sentence = list(range(batch))  # the input sentence of each sentence still in the batch
    done = torch.zeros(batch, dtype=torch.bool)
    for step in range(int(host_max_len.max())):
        logits, _ = model.decode(tokens[:, -1:], memory, src_mask, state)
        rows_max_len = max_len.repeat_interleave(width)
        forcing = bool((step + 1 >= host_max_len).any())
        lprobs = step_log_probs(logits[:, -1], step, rows_max_len, forcing, eos_id, pad_id, cfg.min_len)
        vocab = lprobs.size(-1)
        top, index = best_extensions(scores, lprobs, 2 * k)  # (sentences, 2k)
        beam, token = index // vocab, index % vocab
        ends = (token == eos_id) & top.isfinite()
        present = [finished[i] for i in sentence]
        add_finished(present, done, top, beam, ends, tokens, width, cfg)
        # The best k candidates that do not end in EOS continue (a stable sort keeps their order).
        keep = torch.sort(ends.to(torch.int8), dim=1, stable=True).indices[:, :k]
        scores, beam, token = top.gather(1, keep), beam.gather(1, keep), token.gather(1, keep)
        order = stay_in_place(beam)  # the same beams, in slots that spare cache copies
        scores, beam, token = scores.gather(1, order), beam.gather(1, order), token.gather(1, order)
        done |= search_done(present, scores.cpu(), host_max_len, step, k, cfg.length_penalty)
        if done.all():
            break
        rows = torch.arange(len(sentence), device=src.device)[:, None] * width + beam  # (sentences, k)
        width = k
        if worth_pruning(int(done.sum()), len(sentence)):  # finished sentences leave the batch
            live = (~done).nonzero().flatten()
            sentence, done, host_max_len = [sentence[i] for i in live.tolist()], done[live], host_max_len[live]
            live = live.to(src.device)
            rows, scores, token, max_len = rows[live].view(-1), scores[live], token[live], max_len[live]
            memory, src_mask = select(memory, live), src_mask[live]  # one row per sentence, see cross_attend
            state.reorder(rows, sources=live)
        else:
            rows = rows.view(-1)
            state.reorder_targets(rows)  # beams move within their sentence
        tokens = torch.cat([tokens[rows], token.view(-1, 1)], dim=1)
    return [sorted(f, key=lambda h: -h.score)[: cfg.n_best] for f in finished]


def step_log_probs(
    logits: Tensor, step: int, max_len: Tensor, forcing: bool, eos_id: int, pad_id: int, min_len: int = 0
) -> Tensor:
    """Log-probabilities of the next token; padding is never generated, EOS is forced at max_len
    and refused before min_len tokens. `forcing` says whether any row is at its max_len, which
    the caller knows from its host copy of the lengths without waiting for the device."""
    lprobs = F.log_softmax(logits.float(), dim=-1)  # (rows, vocab)
    lprobs[:, pad_id] = -math.inf
    out_of_room = step + 1 >= max_len
    if step < min_len:
        lprobs[:, eos_id] = torch.where(out_of_room, lprobs[:, eos_id], -math.inf)
    if forcing:
        forced = torch.full_like(lprobs[0], -math.inf)
        forced[eos_id] = 0.0
        lprobs[out_of_room] = torch.where(forced.isfinite(), lprobs[out_of_room], forced)
    return lprobs


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


def search_done(finished, scores: Tensor, max_len: Tensor, step: int, k: int, alpha: float) -> Tensor:
    """(batch,) True where no live beam can beat the k-th best finished hypothesis.

    Log-probabilities only fall as a hypothesis grows, so a live beam's best reachable score is
    its log-probability divided by the largest length penalty it can still get.
    """
    done = torch.zeros(len(finished), dtype=torch.bool)
    for sent, hyps in enumerate(finished):
        if step + 1 >= int(max_len[sent]):
            done[sent] = True
        elif len(hyps) >= k:
            kth_best = sorted(h.score for h in hyps)[-k]
            done[sent] = float(scores[sent].max()) / length_penalty(int(max_len[sent]), alpha) <= kth_best
    return done


def strip_special(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


# --- Corpus-level translation -------------------------------------------------------------------


def decode_batch(model, src: Tensor, tokenizer, cfg: DecodeConfig, generator=None) -> list[list[Hypothesis]]:
    """One padded batch with the configured strategy: n-best lists (one hypothesis unless beam)."""
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    if cfg.strategy == "beam":
        return beam_search(model, src, bos, eos, cfg)
    choose = argmax if cfg.strategy == "greedy" else sampler(cfg, generator)
    return [[h] for h in generate(model, src, bos, eos, cfg, choose)]


def translate_ids(
    model, sources: list[list[int]], tokenizer, cfg: DecodeConfig, device, progress=None
) -> list[list[Hypothesis]]:
    """Translate token-id sentences in length-sorted batches; n-best lists come back in input order.
    With decode.mbr, beam search keeps all beam_size hypotheses and MBR chooses their order."""
    search = dataclasses.replace(cfg, n_best=cfg.beam_size) if cfg.mbr != "none" else cfg
    lengths = np.array([len(s) + 1 for s in sources], dtype=np.int64)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    out: list[list[Hypothesis]] = [[] for _ in sources]
    per_sentence = cfg.beam_size if cfg.strategy == "beam" else 1
    device = torch.device(device)
    amp = autocast_dtype(cfg.precision, device)  # scores and log-probabilities stay fp32 either way
    for indices in token_batches(lengths, max(cfg.max_tokens // per_sentence, 1)):
        src = pad([sources[i] + [tokenizer.eos_id] for i in indices], tokenizer.pad_id).to(device)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            n_best = decode_batch(model, src, tokenizer, search, generator)
        for i, hyps in zip(indices, n_best):
            out[i] = hyps
        if progress is not None:
            progress.update(len(indices))
    if cfg.mbr != "none":
        texts = [tokenizer.decode([h.tokens for h in hyps]) for hyps in out]
        out = [hyps[: cfg.n_best] for hyps in rerank(out, texts, cfg.mbr, cfg.mbr_weights)]
    return out


def encode_sources(texts: list[str], tokenizer, max_tokens: int, source_name: str) -> list[list[int]]:
    """Token ids of each text; a text longer than max_tokens is truncated with a warning naming its line."""
    ids = tokenizer.source.encode(texts)
    for number, sentence in enumerate(ids, 1):
        if len(sentence) > max_tokens:
            log.warning("%s:%d: %d tokens, truncated to %d", source_name, number, len(sentence), max_tokens)
            ids[number - 1] = sentence[:max_tokens]
    return ids


def translate_texts(
    model, texts: list[str], tokenizer, cfg: DecodeConfig, device, progress=None, source_name="input"
) -> list[list[Hypothesis]]:
    """n-best lists for each text, in input order; an empty text gets empty hypotheses."""
    ids = encode_sources(texts, tokenizer, model.cfg.max_positions - 1, source_name)
    todo = [i for i, text in enumerate(texts) if text]
    out = [[Hypothesis([], 0.0, 0.0)] * (cfg.n_best if cfg.strategy == "beam" else 1) for _ in texts]
    for i, hyps in zip(todo, translate_ids(model, [ids[i] for i in todo], tokenizer, cfg, device, progress)):
        out[i] = hyps
    return out


def translate(
    model, texts: list[str], tokenizer, cfg: DecodeConfig, device, progress=None, source_name="input"
) -> list[str]:
    """Best translation of each text, in input order; empty texts give empty translations."""
    n_best = translate_texts(model, texts, tokenizer, cfg, device, progress, source_name)
    return tokenizer.decode([hyps[0].tokens for hyps in n_best])


def translate_corpus(model, corpus: TokenizedCorpus, tokenizer, cfg: DecodeConfig, device) -> list[str]:
    n_best = translate_ids(model, corpus.src, tokenizer, cfg, device)
    return tokenizer.decode([hyps[0].tokens for hyps in n_best])
