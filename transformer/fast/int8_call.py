"""int8 layers inside a compiled decoding step (fast/compiled.py).

A compiled program cannot hold FBGEMM's packed weights (not a tensor), and a program kept on disk
is shared by every model with the same weights. So a traced int8 layer (Int8Call) prepares its
input and scales the product back inside the program, and calls the product itself as the
operator transformer::int8_product, by the layer's name: at run time the operator runs that
layer of the model whose step is running (`products_of`, per thread: a server's threads may
decode with different models).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import Tensor, nn

from .int8 import PREPARE, Int8Linear, scaled_back

_LIBRARY = torch.library.Library("transformer", "DEF")  # kept: the operator lives as long as it
_LIBRARY.define("int8_product(Tensor prepared, str layer, int out_features) -> Tensor")
_running = threading.local()


def _int8_product(prepared: Tensor, layer: str, out_features: int) -> Tensor:
    layers = getattr(_running, "layers", None)
    if layers is None or layer not in layers:
        raise RuntimeError(f"transformer::int8_product called for {layer!r} outside the step of a model that has it")
    return layers[layer].product(prepared)


def _int8_product_shape(prepared: Tensor, layer: str, out_features: int) -> Tensor:
    return prepared.new_empty((*prepared.shape[:-1], out_features), dtype=torch.float32)


_LIBRARY.impl("int8_product", _int8_product, "CPU")
_LIBRARY.impl("int8_product", _int8_product_shape, "Meta")  # shapes, for tracing


def int8_layers(module: nn.Module, prefix: str = "") -> dict[str, Int8Linear]:
    """The Int8Linear layers under `module`, by name (`prefix`: the module's own name)."""
    return {name: m for name, m in module.named_modules(prefix=prefix) if isinstance(m, Int8Linear)}


@contextlib.contextmanager
def products_of(layers: dict[str, Int8Linear]):
    """transformer::int8_product runs `layers` (int8_layers of a model) in this thread for the block."""
    before = getattr(_running, "layers", None)
    _running.layers = layers
    try:
        yield
    finally:
        _running.layers = before


class Int8Call(nn.Module):
    """The Int8Linear `layer`, named `name` in its model, as a traced program computes it: its input
    prepared for its kernel (PREPARE) and its output scaled back and biased in the program, the
    product between them by transformer::int8_product."""

    def __init__(self, layer: Int8Linear, name: str):
        super().__init__()
        self.name, self.kernel, self.out_features = name, layer.kernel, layer.out_features
        self.register_buffer("bias", layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        prepared, scale = PREPARE[self.kernel](x.reshape(-1, x.size(-1)))
        y = torch.ops.transformer.int8_product(prepared, self.name, self.out_features)
        return scaled_back(y, scale, self.bias, x.shape)
