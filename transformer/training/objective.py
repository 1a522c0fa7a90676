"""The training objective: label-smoothed cross-entropy over the full logits (a readable reference
and torch's fused version, which training uses) and R-Drop's symmetric KL regularizer. The
output layer and loss computed together in chunks, the speed path, is the fast runtime's
(FastTransformer.chunked_cross_entropy, transformer/fast/loss.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def label_smoothed_loss(logits: Tensor, target: Tensor, pad_id: int, smoothing: float) -> tuple[Tensor, Tensor]:
    """Summed over non-padding tokens: (label-smoothed loss, plain negative log-likelihood).

    The smoothed target puts 1 - smoothing on the reference token and spreads `smoothing`
    uniformly over the vocabulary.
    """
    lprobs = F.log_softmax(logits.float(), dim=-1)  # (batch, len, vocab)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    uniform = -lprobs.mean(-1)
    keep = target != pad_id
    loss = ((1.0 - smoothing) * nll + smoothing * uniform).masked_fill(~keep, 0.0).sum()
    return loss, nll.masked_fill(~keep, 0.0).sum()


def smoothed_cross_entropy(logits: Tensor, target: Tensor, pad_id: int, smoothing: float) -> Tensor:
    """The label-smoothed loss of `label_smoothed_loss`, summed, computed by torch's fused
    cross-entropy: no (tokens, vocab) temporaries beyond the log-probabilities. Used in training."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), target.flatten(), ignore_index=pad_id, label_smoothing=smoothing, reduction="sum"
    )


def symmetric_kl(logits_a: Tensor, logits_b: Tensor, keep: Tensor) -> Tensor:
    """R-Drop's regularizer (Liang et al. 2021): (KL(p_a || p_b) + KL(p_b || p_a)) / 2, summed over
    the target positions where `keep` is True. logits: (batch, len, vocab); keep: (batch, len)."""
    a, b = F.log_softmax(logits_a.float(), dim=-1), F.log_softmax(logits_b.float(), dim=-1)
    kl = (a.exp() * (a - b) + b.exp() * (b - a)).sum(-1) / 2
    return kl.masked_fill(~keep, 0.0).sum()


def training_objective(
    out: Tensor,
    target: Tensor,
    pad_id: int,
    smoothing: float,
    rdrop: float,
    amp_dtype=None,
    chunked_loss: Callable | None = None,
) -> tuple[Tensor, Tensor]:
    """(summed label-smoothed loss, what training differentiates) for one batch.

    out: the model's logits (the reference), or with `chunked_loss` (a fast model's
    `chunked_cross_entropy`, under runtime.chunked_loss) its decoder output, which that projects
    chunk by chunk; its products run in bf16 under bf16 autocast, and in the weight's dtype
    otherwise (fp16's range would underflow small gradients). With rdrop > 0, out holds the batch
    twice (two dropout draws) and the objective adds R-Drop's regularizer to the mean of the two
    losses."""
    if chunked_loss is not None:
        loss = chunked_loss(out, target, pad_id, smoothing, torch.bfloat16 if amp_dtype == torch.bfloat16 else None)
        return loss, loss
    if rdrop:
        first, second = out.chunk(2)
        loss = (smoothed_cross_entropy(first, target, pad_id, smoothing) + smoothed_cross_entropy(second, target, pad_id, smoothing)) / 2  # fmt: skip
        return loss, loss + rdrop * symmetric_kl(first, second, target != pad_id)
    loss = smoothed_cross_entropy(out, target, pad_id, smoothing)
    return loss, loss
