"""Which attention heads matter: confidence (Voita et al., 2019: the mean over tokens of a head's
largest attention weight) and the BLEU lost when a head is masked out."""

from __future__ import annotations

from dataclasses import replace
from itertools import product

import torch
from torch import Tensor

from ..data.batching import TokenizedCorpus, collate, token_batches
from ..decoding import DecodeConfig, translate_corpus
from ..evaluation import score
from ..model import Transformer, padding_mask


@torch.no_grad()
def head_confidence(
    model: Transformer, corpus: TokenizedCorpus, tokenizer, max_tokens: int = 4096
) -> dict[str, Tensor]:
    """kind -> (layers, heads): the mean, over real (non-padding) query tokens of the corpus with
    teacher forcing, of each head's maximum attention weight."""
    model.eval()
    device = next(model.parameters()).device
    sums: dict[str, Tensor] = {}
    counts = {"encoder_self": 0, "decoder_self": 0, "cross": 0}
    for indices in token_batches(corpus.lengths(), max_tokens):
        batch = collate(corpus, indices, tokenizer).to(device)
        weights = model.attention_weights(batch.src, batch.tgt_in)
        real = {
            "encoder_self": padding_mask(batch.src, tokenizer.pad_id)[:, 0, 0],  # (batch, src_len)
            "decoder_self": batch.tgt_out != tokenizer.pad_id,  # (batch, tgt_len)
        }
        real["cross"] = real["decoder_self"]
        for kind, layers in weights.items():
            mask = real[kind][:, None, :].float()  # (batch, 1, queries)
            peak = torch.stack([(w.amax(-1) * mask).sum(dim=(0, 2)) for w in layers])  # (layers, heads)
            sums[kind] = sums.get(kind, 0) + peak
            counts[kind] += int(mask.sum())
    return {kind: total / counts[kind] for kind, total in sums.items()}


def masked_bleu(
    model: Transformer, corpus: TokenizedCorpus, tokenizer, cfg: DecodeConfig, device, masks: dict | None
) -> float:
    """Corpus BLEU with the given head masks applied (restored afterwards)."""
    model.set_head_mask(masks)
    try:
        hyps = translate_corpus(model, corpus, tokenizer, cfg, device)
    finally:
        model.set_head_mask(None)
    return score(hyps, corpus.tgt_text).bleu


def all_heads(model: Transformer) -> dict[str, Tensor]:
    """Masks of ones: kind -> (layers, heads)."""
    return {kind: torch.ones(len(mods), mods[0].n_heads) for kind, mods in model.attention_modules().items()}


def head_importance(
    model: Transformer, corpus: TokenizedCorpus, tokenizer, cfg: DecodeConfig, device
) -> tuple[float, dict[str, Tensor]]:
    """(BLEU with all heads, kind -> (layers, heads) BLEU lost when only that head is masked)."""
    cfg = replace(cfg, strategy="greedy") if cfg.strategy == "sample" else cfg
    baseline = masked_bleu(model, corpus, tokenizer, cfg, device, None)
    drops = {}
    for kind, ones in all_heads(model).items():
        drop = torch.zeros_like(ones)
        for layer in range(ones.size(0)):
            for head in range(ones.size(1)):
                masks = {kind: ones.clone()}
                masks[kind][layer, head] = 0.0
                drop[layer, head] = baseline - masked_bleu(model, corpus, tokenizer, cfg, device, masks)
        drops[kind] = drop
    return baseline, drops


def prune_least_important(model: Transformer, drops: dict[str, Tensor], k: int) -> dict[str, Tensor]:
    """Masks that remove the k heads whose removal alone cost the least BLEU."""
    ranked = sorted(
        (
            (float(grid[layer, head]), kind, layer, head)
            for kind, grid in drops.items()
            for layer, head in product(range(grid.size(0)), range(grid.size(1)))
        ),
        key=lambda item: item[0],
    )
    masks = all_heads(model)
    for _, kind, layer, head in ranked[:k]:
        masks[kind][layer, head] = 0.0
    return masks
