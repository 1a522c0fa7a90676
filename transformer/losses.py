"""The training objective and schedule: the paper's learning-rate schedule, label-smoothed
cross-entropy (a readable reference, torch's fused version, and the output projection and loss
computed together in chunks, which training uses), R-Drop's symmetric KL regularizer, and the
Adam optimizer training builds."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .linear import linear


def inverse_sqrt_lr(step: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then decay with 1/sqrt(step).

    With peak = d_model^-0.5 * warmup^-0.5 this is the paper's
    lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).
    """
    step = max(step, 1)
    return peak * min(step / warmup, math.sqrt(warmup / step))


SCHEDULES = ("inverse_sqrt", "linear", "cosine")


class Adam(torch.optim.Adam):
    """torch's Adam, whose fused kernel updates the weights without bumping their version counters.
    Inference caches a reordered copy of each weight until its version changes (linear.PackedWeight),
    so after a fused update this bumps them: otherwise validation would go on using the weights of
    the first validation."""

    def step(self, *args, **kwargs):  # GradScaler passes a fused optimizer its scale as keywords
        loss = super().step(*args, **kwargs)
        # Per group: a resumed optimizer takes its groups' settings, "fused" too, from the checkpoint.
        fused = [p for group in self.param_groups if group.get("fused") for p in group["params"]]
        if fused:
            torch.autograd.graph.increment_version(fused)
        return loss


def adam(
    parameters,
    lr: float,
    betas,
    eps: float,
    weight_decay: float,
    device: torch.device,
    fused: bool = True,
    decoupled: bool = False,
):
    """Adam for training. On CPU and CUDA torch's fused implementation updates each weight in one
    pass; the default (foreach) one makes several passes over all the weights and their two
    moments, which on one CPU thread took 4-5x as long for the 8M-parameter Multi30k model
    (docs/SPEED.md). fused=False, or another device, gives the foreach implementation.

    weight_decay is an L2 term added to the gradient (and so rescaled by Adam like the rest of it)
    unless decoupled=True, which shrinks every weight by lr * weight_decay each step on its own:
    AdamW (Loshchilov and Hutter, 2019)."""
    fused = fused and device.type in ("cpu", "cuda")
    return Adam(
        parameters,
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled,
        fused=fused or None,
    )


def trainer_adam(parameters, tcfg, device: torch.device) -> Adam:
    """The optimizer a TrainerConfig asks for."""
    return adam(
        parameters, tcfg.lr, tcfg.betas, tcfg.eps, tcfg.weight_decay, device, decoupled=tcfg.decoupled_weight_decay
    )


def scheduled_lr(
    schedule: str, step: int, peak: float, warmup: int, progress: float, warmup_progress: float, cooldown: float = 0.0
) -> float:
    """The learning rate of `schedule` at optimizer step `step` (1-based), times the cooldown:
    over the last `cooldown` fraction of the budget it falls linearly to 0 (0: no cooldown).

    inverse_sqrt is the paper's schedule (`inverse_sqrt_lr`); it ignores the budget. linear and
    cosine warm up the same way, then decay from `peak` to 0 over the rest of the training
    budget: `progress` is the fraction of the budget used so far and `warmup_progress` the
    fraction used when warmup ended. A run stopped by its budget (steps, epochs or minutes)
    thus ends at a learning rate of 0, which anneals its last weights the way checkpoint
    averaging does, but without the lag of averaging older checkpoints.
    """
    scale = min(1.0, (1.0 - progress) / cooldown) if cooldown > 0 else 1.0
    if schedule == "inverse_sqrt":
        return scale * inverse_sqrt_lr(step, peak, warmup)
    if step < warmup:
        return scale * peak * max(step, 1) / warmup
    decay = (progress - warmup_progress) / max(1.0 - warmup_progress, 1e-9)
    decay = min(max(decay, 0.0), 1.0)
    if schedule == "linear":
        return scale * peak * (1.0 - decay)
    if schedule == "cosine":
        return scale * peak * 0.5 * (1.0 + math.cos(math.pi * decay))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; expected one of {SCHEDULES}")


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


# Rows of logits per chunk in `projected_cross_entropy`: about this many elements, so that a chunk's
# fp32 logits (16 MB on CPU) stay in memory the allocator reuses; GPUs want larger products.
CHUNK_ELEMENTS = {"cpu": 2**22, "cuda": 2**26}


class _ProjectedCrossEntropy(torch.autograd.Function):
    """Label-smoothed cross-entropy of `hidden @ weight.T`, summed over non-padding positions,
    without ever holding the (tokens, vocab) logits: the rows go through in chunks, and each
    chunk's gradients, (softmax - smoothed target) @ weight for the hidden states and its
    transpose product for the weight, are computed in the forward pass, while its logits are at
    hand. Backward only scales them by the incoming gradient. See `projected_cross_entropy`."""

    @staticmethod
    def forward(ctx, hidden, weight, target, pad_id, smoothing, dtype, chunk_rows):
        flat, target = hidden.reshape(-1, hidden.size(-1)), target.reshape(-1)
        keep = (target != pad_id).unsqueeze(1)
        x, w = flat.to(dtype), weight.to(dtype)
        exact = torch.promote_types(dtype, torch.float32)  # softmax and sums: at least fp32
        vocab = w.size(0)
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros(weight.shape, dtype=exact, device=weight.device)
        total = torch.zeros((), dtype=exact, device=weight.device)
        for start in range(0, x.size(0), chunk_rows):
            rows = slice(start, start + chunk_rows)
            z = linear(x[rows], w).to(exact)  # this chunk's logits (fp32 CPU products on oneDNN: linear.py)
            t, kept = target[rows].unsqueeze(1), keep[rows]
            z_target, z_mean = z.gather(1, t), z.mean(1, keepdim=True)
            top = z.amax(1, keepdim=True)
            z.sub_(top).exp_()
            sums = z.sum(1, keepdim=True)
            lse = top + sums.log()
            row_loss = (1.0 - smoothing) * (lse - z_target) + smoothing * (lse - z_mean)
            total += row_loss.masked_fill(~kept, 0.0).sum()
            # d loss / d logits = softmax - ((1 - smoothing) one-hot(target) + smoothing / vocab)
            z.div_(sums).sub_(smoothing / vocab)
            z.scatter_add_(1, t, torch.full_like(z_target, smoothing - 1.0))
            g = z.masked_fill_(~kept, 0.0).to(dtype)
            grad_x[rows] = linear(g, w.t())
            grad_w += torch.mm(g.t(), x[rows])
        ctx.save_for_backward(grad_x.to(hidden.dtype).view_as(hidden), grad_w.to(weight.dtype))
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad, grad_weight * grad, None, None, None, None, None


def projected_cross_entropy(
    hidden: Tensor, weight: Tensor, target: Tensor, pad_id: int, smoothing: float, dtype: torch.dtype | None = None
) -> Tensor:
    """`smoothed_cross_entropy(F.linear(hidden, weight), ...)` without the logits tensor.

    hidden: (batch, len, d_model), the decoder's normalized output; weight: (vocab, d_model), the
    output projection (no bias); target: (batch, len). The products run in `dtype` (e.g. the
    autocast dtype; default: the weight's), the softmax in fp32 or wider. Training spends much of
    a small model's step on the output layer and its loss: the logits and their fp32 copies,
    log-probabilities and gradients are (tokens, vocab) tensors, 131 MB each in fp32 at 4,096
    tokens and 8,000 pieces, allocated afresh every step. Chunked, they are a few MB each and
    reused; scripts/benchmark.py compares the two (implementation ours-logits).
    """
    dtype = dtype or weight.dtype
    chunk = CHUNK_ELEMENTS.get(hidden.device.type, CHUNK_ELEMENTS["cuda"])
    return _ProjectedCrossEntropy.apply(
        hidden, weight, target, pad_id, smoothing, dtype, max(1, chunk // weight.size(0))
    )


def symmetric_kl(logits_a: Tensor, logits_b: Tensor, keep: Tensor) -> Tensor:
    """R-Drop's regularizer (Liang et al. 2021): (KL(p_a || p_b) + KL(p_b || p_a)) / 2, summed over
    the target positions where `keep` is True. logits: (batch, len, vocab); keep: (batch, len)."""
    a, b = F.log_softmax(logits_a.float(), dim=-1), F.log_softmax(logits_b.float(), dim=-1)
    kl = (a.exp() * (a - b) + b.exp() * (b - a)).sum(-1) / 2
    return kl.masked_fill(~keep, 0.0).sum()


def training_objective(
    out: Tensor, target: Tensor, pad_id: int, smoothing: float, rdrop: float, weight: Tensor | None, amp_dtype
) -> tuple[Tensor, Tensor]:
    """(summed label-smoothed loss, what training differentiates) for one batch.

    out: the model's logits, or with `weight` (the output projection) its decoder output, which
    `projected_cross_entropy` projects chunk by chunk; its products run in bf16 under bf16
    autocast, and in the weight's dtype otherwise (fp16's range would underflow small gradients).
    With rdrop > 0, out holds the batch twice (two dropout draws) and the objective adds R-Drop's
    regularizer to the mean of the two losses.
    """
    if weight is not None:
        dtype = torch.bfloat16 if amp_dtype == torch.bfloat16 else None
        loss = projected_cross_entropy(out, weight, target, pad_id, smoothing, dtype)
        return loss, loss
    if rdrop:
        first, second = out.chunk(2)
        loss = (smoothed_cross_entropy(first, target, pad_id, smoothing) + smoothed_cross_entropy(second, target, pad_id, smoothing)) / 2  # fmt: skip
        return loss, loss + rdrop * symmetric_kl(first, second, target != pad_id)
    loss = smoothed_cross_entropy(out, target, pad_id, smoothing)
    return loss, loss
