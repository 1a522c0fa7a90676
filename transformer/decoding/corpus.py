"""Translating a corpus apart from the search: sentences in length-sorted batches of about
decode.max_tokens source tokens, each batch searched with the configured strategy (strategies.py)
under the configured precision, n-best lists back in input order and reranked by MBR when asked;
texts in, texts out."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
from torch import Tensor

from ..data import TokenizedCorpus, pad, token_batches
from ..devices import autocast_dtype
from .config import DecodeConfig
from .mbr import rerank
from .search import Hypothesis
from .strategies import STRATEGIES

log = logging.getLogger(__name__)


def decode_batch(model, src: Tensor, tokenizer, cfg: DecodeConfig, generator=None) -> list[list[Hypothesis]]:
    """One padded batch with the configured strategy: n-best lists (one hypothesis unless it ranks a beam)."""
    search = STRATEGIES[cfg.strategy].search
    return search(model, src, tokenizer.bos_id, tokenizer.eos_id, cfg, generator)


def translate_ids(
    model, sources: list[list[int]], tokenizer, cfg: DecodeConfig, device, progress=None
) -> list[list[Hypothesis]]:
    """Translate token-id sentences in length-sorted batches; n-best lists come back in input order.
    With decode.mbr, beam search keeps all beam_size hypotheses and MBR chooses their order."""
    search = dataclasses.replace(cfg, n_best=cfg.beam_size) if cfg.mbr != "none" else cfg
    lengths = np.array([len(s) + 1 for s in sources], dtype=np.int64)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    out: list[list[Hypothesis]] = [[] for _ in sources]
    per_sentence = STRATEGIES[cfg.strategy].rows_per_sentence(cfg)
    device = torch.device(device)
    # Scores and log-probabilities stay fp32 either way; int8 is in the model's layers (load_decoder).
    amp = None if cfg.precision == "int8" else autocast_dtype(cfg.precision, device)
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
    per_sentence = STRATEGIES[cfg.strategy].hypotheses_per_sentence(cfg)
    out = [[Hypothesis([], 0.0, 0.0)] * per_sentence for _ in texts]
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
    """Best translation of each sentence of a tokenized corpus, in its order."""
    n_best = translate_ids(model, corpus.src, tokenizer, cfg, device)
    return tokenizer.decode([hyps[0].tokens for hyps in n_best])
