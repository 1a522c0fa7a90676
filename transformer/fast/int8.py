"""int8 decoding on CPU (decode.precision=int8): every linear layer's weight quantized to int8 per
output channel once, its input quantized per row (per token) at each product, and the product
computed in int8 by oneDNN (`torch.ops.onednn.qlinear_pointwise`, VNNI or AMX where the CPU has them).

Why per row: torch's dynamic quantization (`quantize_dynamic`) quantizes a layer's whole input
with one scale per call, on 7 bits (reduce_range, for FBGEMM's kernels): the scale of a decoding
step is set by the largest value of any row of the batch (padding included), so a sentence's
output depended on the other sentences batched with it, and its small activations lost most of
their precision. Here each row is scaled to [-127, 127] by its own maximum, as CTranslate2 does.

The embeddings, and with them the tied output projection, stay fp32, as do norms, softmax and
the attention products.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .linear import Linear

ROW_SCALE = 127.0  # a row's largest magnitude maps to this int8 value


def available() -> bool:
    """Whether this torch build has oneDNN's quantized linear product."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row: x (rows, features) -> int8 values and (rows, 1) scales, x ~ q * scale."""
    largest = x.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(x.dtype).tiny)
    return (x * (ROW_SCALE / largest)).round_().to(torch.int8), largest / ROW_SCALE


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (one scale per output channel) and x quantized per row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, w_scale = quantize_rows(linear.weight.detach().float())
        self.register_buffer("w_scale", w_scale.flatten().contiguous())  # (out,)
        self.register_buffer("w_zero", torch.zeros(self.out_features, dtype=torch.int32))
        self.register_buffer("packed", torch.ops.onednn.qlinear_prepack(weight, None))  # oneDNN's layout
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).float()
        q, scale = quantize_rows(rows)
        # The product of int8 values, scaled by the weights' channel scales: (rows, out) in fp32.
        y = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, self.packed, self.w_scale, self.w_zero, None, 1.0, 0, torch.float32, "none", [], "")  # fmt: skip
        y = y * scale if self.bias is None else torch.addcmul(self.bias, y, scale)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace, in place, every nn.Linear of `model` (fast/linear.py's `Linear` included) by an
    Int8Linear; returns `model`."""
    if not available():
        raise RuntimeError("decode.precision=int8 needs torch with oneDNN's quantized linear (torch.ops.onednn)")
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) in (nn.Linear, Linear):
                setattr(parent, name, Int8Linear(child))
    return model
