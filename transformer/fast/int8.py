"""int8 decoding on CPU (decode.precision=int8): every linear layer's weight quantized to int8 per
output channel, its input quantized per batch at each product (dynamic quantization), by torch's
own quantized linear kernels (torch.ao.quantization.quantize_dynamic; FBGEMM/oneDNN underneath).

The embeddings, and with them the tied output projection, stay fp32, as do norms, softmax and
the attention products. torch marks torch.ao.quantization as deprecated in favour of torchao;
its dynamic int8 linear is still what it ships for eager CPU inference, so its deprecation
warnings are silenced here, once, where the model is converted.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .linear import Linear


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace, in place, every nn.Linear of `model` (fast/linear.py's `Linear` included) by torch's
    dynamically quantized int8 Linear with per-channel weight scales; returns `model`."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    for module in model.modules():  # fast/linear.py's Linear back to nn.Linear: same parameters
        if type(module) is Linear:
            module.__class__ = nn.Linear
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
