"""The model-level fast paths: the classes `accelerate` gives a built Transformer, its decoder
layers, feed-forward networks and rotary positions. Each overrides one method of its reference class and keeps
its parameters, so state dicts and checkpoints are the same under every runtime."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..model import DecoderLayer, DecoderState, Transformer
from ..model.attention import Rotary
from ..model.blocks import FeedForward
from .cache import FastKeyValueCache
from .compiled import CompiledStep
from .encoding import encode_grouped
from .linear import FastLinear, PackedWeight, linear, onednn_now
from .loss import projected_cross_entropy


class FastTransformer(Transformer):
    """Encoding in length groups at CPU inference, the tied output projection (and its logits
    bias, if any) on oneDNN with its weight packed for inference, decoding states whose caches grow in
    place, and with runtime.chunked_loss the output layer and training loss in chunks (fast/loss.py)."""

    def adopt(self, runtime) -> None:
        self.tied_packed, self.onednn, self.chunked_loss = PackedWeight(runtime.inference_by_rows), runtime.onednn, runtime.chunked_loss  # fmt: skip
        self.onednn_inference, self.fp32_cross = runtime.onednn_inference, runtime.fp32_cross
        self.compiled_step = CompiledStep(runtime.compiled_step, FastDecoderLayer)

    def chunked_cross_entropy(self, out: Tensor, target: Tensor, pad_id: int, smoothing: float, dtype) -> Tensor:
        """The summed label-smoothed loss of the decoder output `out` (forward(project=False)),
        projected by the output layer chunk by chunk, never holding the full logits; products in
        `dtype` (bf16 under bf16 autocast) or, for None, in the weight's dtype."""
        return projected_cross_entropy(
            out, self.output_weight, target, pad_id, smoothing, dtype, self.onednn, self.logits_bias
        )

    def encode(self, src: Tensor, src_mask: Tensor, need_weights: bool = False) -> tuple[Tensor, list]:
        if need_weights or torch.is_grad_enabled() or self.training or src.device.type != "cpu":
            return super().encode(src, src_mask, need_weights)
        return encode_grouped(super().encode, src, src_mask)

    def decode(self, tgt, memory, src_mask, state=None, need_weights=False, project=True):
        """The reference decode, or for a step it takes, the compiled step (fast/compiled.py) and
        this model's own output layer; both read and write the same caches."""
        step = getattr(self, "compiled_step", None)
        if step is None or not step.take(self, tgt, state, need_weights):
            return super().decode(tgt, memory, src_mask, state, need_weights, project)
        hidden = step(self, tgt, src_mask, state)
        return (self.project(hidden) if project else hidden), []

    def project(self, x: Tensor) -> Tensor:
        if self.output is not None:
            return super().project(x)
        onednn = onednn_now(self.onednn, self.onednn_inference)
        return linear(x, self.embed.embed.weight, self.logits_bias, self.tied_packed, onednn=onednn)

    def vocabulary_projection(self, ids: Tensor):
        """The tied projection's rows `ids` on oneDNN, their weight packed once for the batch."""
        if self.output is not None:
            return super().vocabulary_projection(ids)
        weight, bias = self.vocabulary_rows(ids)
        packed, onednn = PackedWeight(self.tied_packed.by_rows), onednn_now(self.onednn, self.onednn_inference)
        return lambda x: linear(x, weight, bias, packed, onednn=onednn)

    def new_state(self) -> DecoderState:
        """A decoding state whose caches grow in place (fast/cache.py)."""
        return DecoderState(new_cache=functools.partial(FastKeyValueCache, self.fp32_cross))


class FastDecoderLayer(DecoderLayer):
    """Cross-attention with each sentence's rows (beam search's beams) folded into one longer
    query: every query attends on its own, so the result is the same, and the source-side keys
    and values are computed, cached and read once per sentence instead of once per beam."""

    def attend_memory(self, query: Tensor, memory: Tensor | None, src_mask: Tensor, cache, need_weights: bool):
        sentences = memory.size(0) if memory is not None else cache.memory()[0].size(0)
        rows, length = query.shape[:2]
        if rows == sentences:
            return super().attend_memory(query, memory, src_mask, cache, need_weights)
        index, width = cache.folding(rows, sentences) if cache is not None else (None, rows // sentences)
        if index is None:  # consecutive rows, `width` per sentence
            if width * sentences != rows:
                raise ValueError(f"{rows} target rows do not divide into {sentences} sentences")
            grid = query.reshape(sentences, width * length, -1)
        else:  # each row at its place in a (sentences, width) grid; the empty places are zeros
            grid = query.new_zeros(sentences * width, length, query.size(-1)).index_copy_(0, index, query)
            grid = grid.view(sentences, width * length, -1)
        out, weights = self.cross_attn(grid, memory, src_mask, cache, True, need_weights)
        if weights is not None:  # (sentences, heads, width * len, src_len) -> (rows, heads, len, src_len)
            weights = weights.unflatten(2, (width, length)).transpose(1, 2).flatten(0, 1)
            weights = weights if index is None else weights.index_select(0, index)
        out = out.reshape(sentences * width, length, -1)
        return (out if index is None else out.index_select(0, index)), weights


class FastFeedForward(FeedForward):
    """The activation (ReLU, GELU or SiLU) applied by oneDNN inside the first product (fast/linear.py); int8 linear
    layers (fast/int8.py) take the reference path."""

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(self.linear1, FastLinear):
            return super().forward(x)
        return self.linear2(self.dropout(self.linear1(x, activation=self.activation)))


class FastRotary(Rotary):
    """Rotary positions as one complex product: a feature pair (x_2i, x_2i+1) is the complex
    number x_2i + i x_2i+1, and turning it by the angle a multiplies it by cos a + i sin a. The
    same products as the reference's, in one kernel each way instead of strided slices, four
    real products and a stack. fp32 and fp64 only (torch has no bf16 complex numbers)."""

    def turn(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if x.dtype not in (torch.float32, torch.float64):
            return super().turn(x, cos, sin)
        pairs = x.unflatten(-1, (-1, 2))
        if pairs.storage_offset() % 2 or any(stride % 2 for stride in pairs.stride()[:-2]):
            pairs = pairs.contiguous()  # a complex view needs pairs that start at even offsets
        return torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos, sin)).flatten(-2)
