"""The output layer and its label-smoothed cross-entropy computed together, in chunks of rows,
never holding the (tokens, vocab) logits: the speed path of the training objective, whose
reference is the full logits and `transformer.training.objective.smoothed_cross_entropy`
(tests/test_losses.py compares the two). Training takes it with runtime.chunked_loss=true."""

from __future__ import annotations

import torch
from torch import Tensor

from .linear import linear

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
    def forward(ctx, hidden, weight, bias, target, pad_id, smoothing, dtype, chunk_rows, onednn):
        flat, target = hidden.reshape(-1, hidden.size(-1)), target.reshape(-1)
        keep = (target != pad_id).unsqueeze(1)
        x, w, b = flat.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        exact = torch.promote_types(dtype, torch.float32)  # softmax and sums: at least fp32
        vocab = w.size(0)
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros(weight.shape, dtype=exact, device=weight.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=exact, device=bias.device)
        total = torch.zeros((), dtype=exact, device=weight.device)
        for start in range(0, x.size(0), chunk_rows):
            rows = slice(start, start + chunk_rows)
            z = linear(x[rows], w, b, onednn=onednn).to(exact)  # this chunk's logits (fp32 CPU: oneDNN, linear.py)
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
            grad_x[rows] = linear(g, w.t(), onednn=onednn)
            grad_w += torch.mm(g.t(), x[rows])
            if grad_b is not None:
                grad_b += g.sum(0)
        ctx.grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        ctx.save_for_backward(grad_x.to(hidden.dtype).view_as(hidden), grad_w.to(weight.dtype))
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_bias = None if ctx.grad_b is None else ctx.grad_b * grad
        return grad_hidden * grad, grad_weight * grad, grad_bias, None, None, None, None, None, None


def projected_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    pad_id: int,
    smoothing: float,
    dtype: torch.dtype | None = None,
    onednn: bool = True,
    bias: Tensor | None = None,
) -> Tensor:
    """`smoothed_cross_entropy(F.linear(hidden, weight, bias), ...)` without the logits tensor.

    hidden: (batch, len, d_model), the decoder's normalized output; weight: (vocab, d_model), the
    output projection, and bias (vocab,) the logits bias if the model has one; target: (batch, len). The products run in `dtype` (e.g. the
    autocast dtype; default: the weight's), the softmax in fp32 or wider; onednn=False keeps the
    products on F.linear (runtime.onednn_linear). Training spends much of a small model's step on
    the output layer and its loss: the logits and their fp32 copies, log-probabilities and
    gradients are (tokens, vocab) tensors allocated afresh every step. Chunked, they are a few MB
    each and reused; scripts/benchmark.py compares the two (implementation ours-logits).
    """
    dtype = dtype or weight.dtype
    chunk = CHUNK_ELEMENTS.get(hidden.device.type, CHUNK_ELEMENTS["cuda"])
    return _ProjectedCrossEntropy.apply(
        hidden, weight, bias, target, pad_id, smoothing, dtype, max(1, chunk // weight.size(0)), onednn
    )
