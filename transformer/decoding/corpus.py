"""Translating a corpus apart from the search: sentences in length-sorted batches of about
decode.max_tokens source tokens, each batch searched with the configured strategy (strategies.py)
under the configured precision, n-best lists back in input order and reranked by MBR when asked;
texts in, texts out; and scoring given translations (`score_ids`)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
from torch import Tensor

from ..data.batching import TokenizedCorpus, pad, token_batches
from ..devices import autocast_dtype
from ..model import padding_mask
from .config import DecodeConfig
from .constrained import constrained_beam_search
from .inputs import encode_constraints, encode_prefixes
from .mbr import rerank
from .search import Hypothesis
from .shortlist import ShortlistModel
from .strategies import STRATEGIES

log = logging.getLogger(__name__)


def decode_batch(
    model, src: Tensor, tokenizer, cfg: DecodeConfig, generator=None, prefix: Tensor | None = None, constraints=None
) -> list[list[Hypothesis]]:
    """One padded batch with the configured strategy: n-best lists (one hypothesis unless it ranks
    a beam); with a target prefix (batch, prefix_len; -1 after its end), each starts with its own;
    with constraints (per sentence, its phrases as token ids), constrained beam search. A model
    with a shortlist (shortlist.py) is narrowed to this batch's candidates first."""
    constrained = constraints is not None and any(constraints)
    if isinstance(model, ShortlistModel):  # constrained search indexes the vocabulary: full rows
        model = model.for_batch(src, wanted_ids(prefix, constraints), narrow=not constrained)
    if constrained:
        return constrained_beam_search(model, src, tokenizer.bos_id, tokenizer.eos_id, cfg, constraints)
    search = STRATEGIES[cfg.strategy].search
    return search(model, src, tokenizer.bos_id, tokenizer.eos_id, cfg, generator, prefix)


def wanted_ids(prefix: Tensor | None, constraints) -> Tensor | None:
    """(batch, n) the target ids each sentence's prefix and constraints ask for, -1 elsewhere."""
    phrases = [[t for phrase in sentence for t in phrase] for sentence in constraints or []]
    if prefix is None and not any(phrases):
        return None
    wanted = [] if prefix is None else [prefix.cpu()]
    if any(phrases):
        wanted.append(pad(phrases, -1))
    return torch.cat(wanted, dim=1)


def translate_ids(
    model,
    sources: list[list[int]],
    tokenizer,
    cfg: DecodeConfig,
    device,
    progress=None,
    prefixes=None,
    constraints=None,
    precision: str = "fp32",
) -> list[list[Hypothesis]]:
    """Translate token-id sentences in length-sorted batches; n-best lists come back in input order.
    With decode.mbr, beam search keeps all beam_size hypotheses and MBR chooses their order.
    prefixes: None, or each sentence's target token ids that its translations must start with;
    constraints: None, or each sentence's target phrases (token ids) that its translations must
    contain (beam search only, constrained.py); precision: the model's (runtime.precision), bf16
    or fp16 run the batches under autocast."""
    search = dataclasses.replace(cfg, n_best=cfg.beam_size) if cfg.mbr != "none" else cfg
    lengths = np.array([len(s) + 1 for s in sources], dtype=np.int64)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    out: list[list[Hypothesis]] = [[] for _ in sources]
    per_sentence = STRATEGIES[cfg.strategy].rows_per_sentence(cfg)
    device = torch.device(device)
    # Scores and log-probabilities stay fp32 either way; int8 is in the model's layers (transformer.translator).
    amp = autocast_dtype(precision, device)
    for indices in token_batches(lengths, max(cfg.max_tokens // per_sentence, 1)):
        src = pad([sources[i] + [tokenizer.eos_id] for i in indices], tokenizer.pad_id).to(device)
        prefix = batch_prefix([prefixes[i] for i in indices], device) if prefixes else None
        phrases = [constraints[i] for i in indices] if constraints else None
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            n_best = decode_batch(model, src, tokenizer, search, generator, prefix, phrases)
        for i, hyps in zip(indices, n_best):
            out[i] = hyps
        if progress is not None:
            progress.update(len(indices))
    if cfg.mbr != "none":
        texts = [tokenizer.decode([h.tokens for h in hyps]) for hyps in out]
        out = [hyps[: cfg.n_best] for hyps in rerank(out, texts, cfg.mbr, cfg.mbr_weights)]
    return out


@torch.no_grad()
def score_ids(model, sources: list[list[int]], targets: list[list[int]], tokenizer, cfg: DecodeConfig, device, precision: str = "fp32") -> list[list[float]]:  # fmt: skip
    """Each target's log-probability token by token, its EOS last, given its source (teacher
    forcing: what CTranslate2's score_batch and Marian's scorer give), in input order. Batches of
    about decode.max_tokens source and target tokens, sorted by length, under `precision`;
    the log-probabilities are fp32. Ensembles score with their mean distribution."""
    lengths = np.array([len(s) + len(t) + 2 for s, t in zip(sources, targets)], dtype=np.int64)
    out: list[list[float]] = [[] for _ in sources]
    device = torch.device(device)
    amp = autocast_dtype(precision, device)
    for indices in token_batches(lengths, cfg.max_tokens):
        src = pad([sources[i] + [tokenizer.eos_id] for i in indices], tokenizer.pad_id).to(device)
        given = pad([[tokenizer.bos_id] + targets[i] for i in indices], tokenizer.pad_id).to(device)
        gold = pad([targets[i] + [tokenizer.eos_id] for i in indices], tokenizer.pad_id).to(device)
        src_mask = padding_mask(src, tokenizer.pad_id)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            memory, _ = model.encode(src, src_mask)
            logits, _ = model.decode(given, memory, src_mask, model.new_state())
        lprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, gold[..., None]).squeeze(-1)
        for row, i in enumerate(indices):
            out[i] = lprobs[row, : len(targets[i]) + 1].tolist()
    return out


def batch_prefix(prefixes: list[list[int]], device) -> Tensor | None:
    """The prefixes of one batch as (batch, longest) token ids, -1 after each one's end; None if all are empty."""
    return pad(prefixes, -1).to(device) if any(prefixes) else None


def encode_sources(
    texts: list[str], tokenizer, max_tokens: int, source_name: str, first_line: int = 1, tag: int | None = None
) -> list[list[int]]:
    """Token ids of each text; a text longer than max_tokens is truncated with a warning naming its
    line (texts[0] is line `first_line` of source_name). tag: a target-language tag id each
    nonempty text starts with (a many-to-many model's), not counted in max_tokens."""
    ids = tokenizer.source.encode(texts)
    for i, sentence in enumerate(ids):
        if len(sentence) > max_tokens:
            log.warning("%s:%d: %d tokens, truncated to %d", source_name, first_line + i, len(sentence), max_tokens)
            ids[i] = sentence = sentence[:max_tokens]
        if tag is not None and sentence:
            ids[i] = [tag, *sentence]
    return ids


def translate_texts(
    model,
    texts: list[str],
    tokenizer,
    cfg: DecodeConfig,
    device,
    progress=None,
    source_name="input",
    first_line=1,
    prefixes=None,
    constraints=None,
    tag: int | None = None,
    precision: str = "fp32",
) -> list[list[Hypothesis]]:
    """n-best lists for each text, in input order; an empty text gets empty hypotheses. Warnings
    and errors name texts[0] line `first_line` of source_name. prefixes: None, or for each text the
    target text its translations must start with ("" for none); constraints: None, or for each
    text the target phrases its translations must contain. tag: the target-language tag id that
    starts every source (a many-to-many model's), or None. precision: translate_ids's."""
    limit = model.cfg.max_positions - 1
    ids = encode_sources(texts, tokenizer, limit - (tag is not None), source_name, first_line, tag)
    forced = None if prefixes is None else encode_prefixes(prefixes, tokenizer, limit, source_name, first_line)
    phrases = None if constraints is None else encode_constraints(constraints, tokenizer, cfg, limit, source_name, first_line)  # fmt: skip
    todo = [i for i, text in enumerate(texts) if text]
    per_sentence = STRATEGIES[cfg.strategy].hypotheses_per_sentence(cfg)
    out = [[Hypothesis([], 0.0, 0.0)] * per_sentence for _ in texts]
    chosen = None if forced is None else [forced[i] for i in todo]
    required = None if phrases is None else [phrases[i] for i in todo]
    n_best = translate_ids(model, [ids[i] for i in todo], tokenizer, cfg, device, progress, chosen, required, precision)
    for i, hyps in zip(todo, n_best):
        out[i] = hyps
    return out


def translate(model, texts: list[str], tokenizer, cfg: DecodeConfig, device, progress=None, source_name="input", tag=None, precision: str = "fp32") -> list[str]:  # fmt: skip
    """Best translation of each text, in input order; empty texts give empty translations."""
    n_best = translate_texts(model, texts, tokenizer, cfg, device, progress, source_name, tag=tag, precision=precision)
    return tokenizer.decode([hyps[0].tokens for hyps in n_best])


def translate_corpus(model, corpus: TokenizedCorpus, tokenizer, cfg: DecodeConfig, device, precision: str = "fp32") -> list[str]:  # fmt: skip
    """Best translation of each sentence of a tokenized corpus, in its order."""
    n_best = translate_ids(model, corpus.src, tokenizer, cfg, device, precision=precision)
    return tokenizer.decode([hyps[0].tokens for hyps in n_best])
