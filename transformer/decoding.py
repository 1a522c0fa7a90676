"""Decoding strategies. Each one encodes the source once and then extends the target one token
per step through `Transformer.decode` with a `DecoderState` (the incremental-state interface)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .data import TokenizedCorpus, pad, token_batches
from .model import DecoderState, Transformer, padding_mask


@dataclass
class DecodeConfig:
    max_len_a: float = 1.2  # a translation of a source of n tokens has at most a * n + b tokens
    max_len_b: int = 10
    max_tokens: int = 8192  # source tokens per decoding batch


def max_lengths(src_mask: Tensor, cfg: DecodeConfig, limit: int) -> Tensor:
    """(batch,) maximum number of generated tokens per sentence, EOS included."""
    src_lens = src_mask.flatten(1).sum(-1)
    return (src_lens * cfg.max_len_a + cfg.max_len_b).long().clamp(max=limit)


@torch.no_grad()
def greedy(model: Transformer, src: Tensor, bos_id: int, eos_id: int, cfg: DecodeConfig) -> list[list[int]]:
    """Pick the most probable next token at every step. src: (batch, src_len) -> token ids, no BOS/EOS."""
    src_mask = padding_mask(src, model.cfg.pad_id)
    memory, _ = model.encode(src, src_mask)
    max_len = max_lengths(src_mask, cfg, model.cfg.max_positions - 1)
    tokens = torch.full((src.size(0), 1), bos_id, dtype=torch.long, device=src.device)
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    state = DecoderState()
    for step in range(int(max_len.max())):
        logits, _ = model.decode(tokens[:, -1:], memory, src_mask, state)  # (batch, 1, vocab)
        next_token = logits[:, -1].argmax(-1)
        next_token = torch.where(step + 1 >= max_len, eos_id, next_token)  # out of room: end here
        next_token = torch.where(done, model.cfg.pad_id, next_token)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        done |= next_token == eos_id
        if done.all():
            break
    return [strip_special(row, eos_id) for row in tokens[:, 1:].tolist()]


def strip_special(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


def translate_ids(
    model: Transformer, sources: list[list[int]], tokenizer, cfg: DecodeConfig, device: torch.device
) -> list[list[int]]:
    """Translate token-id sentences in length-sorted batches; results come back in input order."""
    model.eval()
    lengths = np.array([len(s) + 1 for s in sources], dtype=np.int64)
    out: list[list[int]] = [[] for _ in sources]
    for indices in token_batches(lengths, cfg.max_tokens):
        src = pad([sources[i] + [tokenizer.eos_id] for i in indices], tokenizer.pad_id).to(device)
        for i, hyp in zip(indices, greedy(model, src, tokenizer.bos_id, tokenizer.eos_id, cfg)):
            out[i] = hyp
    return out


def translate(model: Transformer, texts: list[str], tokenizer, cfg: DecodeConfig, device: torch.device) -> list[str]:
    limit = model.cfg.max_positions - 1
    ids = [s[:limit] for s in tokenizer.encode(texts)]
    return tokenizer.decode(translate_ids(model, ids, tokenizer, cfg, device))


def translate_corpus(model, corpus: TokenizedCorpus, tokenizer, cfg: DecodeConfig, device) -> list[str]:
    return tokenizer.decode(translate_ids(model, corpus.src, tokenizer, cfg, device))
