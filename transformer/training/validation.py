"""Validation during training: the per-token loss of the validation split (its exponential is the
perplexity) and greedy BLEU and chrF, which pick the best checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..data.batching import TokenizedCorpus, collate, token_batches
from ..decoding import DecodeConfig
from ..evaluation import score
from ..monitoring import progress_bar
from ..translator import Translator
from .objective import label_smoothed_loss


@dataclass
class Validation:
    loss: float
    bleu: float | None = None  # None when BLEU was not asked for
    chrf: float | None = None
    hyp_ids: list[list[int]] = field(default_factory=list)  # greedy translations, token ids
    hyps: list[str] = field(default_factory=list)  # and detokenized
    directions: dict[str, float] = field(default_factory=dict)  # a many-to-many split: each direction's BLEU


def split_scores(hyps: list[str], data: TokenizedCorpus) -> tuple[float, float, dict[str, float]]:
    """(BLEU, chrF, {direction: BLEU}) of translations of `data`: for a split of several
    directions, the unweighted means of the directions' corpus scores (each direction counts
    the same, however many sentences it has) and each one's BLEU; else the corpus scores and {}."""
    groups = data.directions()
    if len(groups) == 1 and data.direction is None:
        scores = score(hyps, data.tgt_text)
        return scores.bleu, scores.chrf, {}
    each = {name: score([hyps[i] for i in rows], [data.tgt_text[i] for i in rows]) for name, rows in groups.items()}
    bleu = sum(s.bleu for s in each.values()) / len(each)
    chrf = sum(s.chrf for s in each.values()) / len(each)
    return bleu, chrf, {name: s.bleu for name, s in each.items()}


@torch.no_grad()
def validation_loss(model, data: TokenizedCorpus, tokenizer, max_tokens: int, device, amp_dtype) -> float:
    """Per-token negative log-likelihood of `data`, in batches of at most max_tokens."""
    model.eval()
    nll_sum, n_tokens = torch.zeros((), device=device), 0
    for indices in token_batches(data.lengths(), max_tokens):
        batch = collate(data, indices, tokenizer).to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(batch.src, batch.tgt_in)
        nll_sum += label_smoothed_loss(logits, batch.tgt_out, tokenizer.pad_id, 0.0)[1]
        n_tokens += batch.n_tgt_tokens
    return float(nll_sum) / n_tokens


def validate(
    model,
    data: TokenizedCorpus,
    tokenizer,
    decode: DecodeConfig,
    max_tokens: int,
    device,
    amp_dtype,
    bleu: bool,
    precision: str = "fp32",
) -> Validation:
    """The loss and, with bleu=True, greedy translations scored against the references (for a
    many-to-many run, the mean over its directions, which selects its best checkpoint). Greedy
    rather than the configured strategy: it is fast, and ranks checkpoints well enough. The
    translations decode in `precision` (runtime.precision), as the test splits do."""
    result = Validation(validation_loss(model, data, tokenizer, max_tokens, device, amp_dtype))
    if bleu:
        with progress_bar(len(data), "validate") as bar:
            n_best = Translator.of_training(model, tokenizer, decode.greedy(), precision).translate_ids(
                data.src, progress=bar
            )
        result.hyp_ids = [hyps[0].tokens for hyps in n_best]
        result.hyps = tokenizer.decode(result.hyp_ids)
        result.bleu, result.chrf, result.directions = split_scores(result.hyps, data)
    return result
