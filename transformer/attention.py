"""Attention: scaled dot-product attention and multi-head attention (W_q, W_k, W_v, W_o).

Shapes: queries (batch, heads, q_len, d_head); keys and values (batch, kv_heads, k_len, d_head);
a mask, True where a query may attend to a key, broadcasts to (batch, heads, q_len, k_len).
Attention variants live here, beside the standard one, so the layers in model.py stay the same.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cache
from .linear import Linear

# Decoding in bf16 on CPU keeps the cross-attention keys and values in fp32 and attends to them in
# fp32: at a decoding step's shapes (one query per row, a dozen or two keys) torch's fp32 batched
# products took about half the time of its bf16 ones on a Zen 5 EPYC, and greedy decoding became
# 1.10x (small) and 1.11x (base) faster; beam 5, with its beams folded into longer queries, 0.99-1.01x.
# The cache is computed once per batch, so the one cast costs little. A switch for comparisons.
FP32_CROSS = True


def expand_kv_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Grouped-query: repeat each key/value head for the group of query heads it serves."""
    if k.size(1) == q.size(1):
        return k, v
    group = q.size(1) // k.size(1)
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def attention_with_weights(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float):
    """The explicit softmax(QK^T / sqrt(d_head)) V, returning the weights too (for inspection).

    q: (batch, heads, q_len, d_head); k, v: (batch, kv_heads, k_len, d_head).
    """
    k, v = expand_kv_heads(q, k, v)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (batch, heads, q_len, k_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    return F.dropout(weights, dropout_p) @ v, weights


def fast_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    """F.scaled_dot_product_attention with grouped-query support; same shapes as above.

    Two CPU cases (torch 2.13, measured on 2 cores) take two batched products instead
    (`product_attention`):
    - bf16 with gradients (training under autocast): forward + backward at the training shapes
      of Multi30k batches took 2.4-2.6x less time than the math kernel and 3.7-8x less than the
      flash kernel on a Zen 5 EPYC (on a Zen 4 the flash kernel's backward was also the slowest),
      and they keep q, k, v in bf16 for the backward pass where the math kernel saves fp32 copies;
    - inference with few queries (a decoding step: one query per row, or a sentence's beams folded
      together) or, in bf16, short keys: the fused kernels cost 1.3-4x as much as the products.
    """
    gqa = k.size(1) != q.size(1)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if q.device.type == "cpu" and not needs_grad and dropout_p == 0.0:
        if q.size(2) <= 16 or (q.dtype == torch.bfloat16 and k.size(2) <= 128):
            return product_attention(q, k, v, mask)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and needs_grad:
        return product_attention(q, k, v, mask, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


def product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float = 0.0) -> Tensor:
    """softmax(QK^T / sqrt(d_head)) V as two batched matrix products and an fp32 softmax, with
    dropout on the weights but without returning them; same shapes as fast_attention.

    Grouped-query heads fold into the query length when the mask allows (one row per key), so
    each key/value head is read once for its whole group instead of being copied per query head."""
    batch, heads, q_len, d_head = q.shape
    kv_heads = k.size(1)
    folded = kv_heads != heads and (mask is None or mask.size(1) == mask.size(2) == 1)
    if folded:
        q = q.reshape(batch, kv_heads, heads // kv_heads * q_len, d_head)
    else:
        k, v = expand_kv_heads(q, k, v)
    scores = torch.matmul(q, k.transpose(-2, -1)) * d_head**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))  # bf16: in fp32
    if dropout_p > 0.0:
        weights = F.dropout(weights, dropout_p)
    out = torch.matmul(weights.to(v.dtype), v)
    return out.reshape(batch, heads, q_len, d_head) if folded else out


def whole_cache(state: dict, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """A decoding step's self-attention keys and values as the cache's whole buffers, with a mask
    that hides the slots past the tokens so far: (k, v, mask), or the arguments unchanged (no mask)
    when the cache holds no growing buffers.

    For bf16 on CPU torch's batched product copies an operand whose batches are not packed one
    after the other, and the cached keys and values, a narrowed view of a longer buffer, are not.
    The whole buffer is, so the products read it in place: at the decoding shapes of the small and
    base models (64-320 rows, 4-8 heads, 17-30 tokens in a 32-slot buffer) the attention took 1.6-2.5x
    less time on a Zen 5 EPYC, with the same result, although it scores up to twice the keys.
    In fp32 the product reads the view in place, so this is for bf16 only."""
    keys, values = cache.whole(state, "k"), cache.whole(state, "v")
    if keys is None or values is None:
        return k, v, None
    (k_buffer, filled), (v_buffer, _) = keys, values
    if filled == k_buffer.size(2):  # full: the view is the buffer
        return k, v, None
    mask = torch.arange(k_buffer.size(2), device=k.device) < filled
    return k_buffer, v_buffer, mask.view(1, 1, 1, -1)


class Rotary(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021): rotate each pair of query/key features
    by an angle proportional to the position, so q.k depends on the positions' difference only.

    One instance is shared by every self-attention layer; its tables are not saved (they are a
    function of the shape). Cross-attention takes no positions.
    """

    def __init__(self, d_head: int, max_positions: int, base: float = 10000.0):
        super().__init__()
        if d_head % 2:
            raise ValueError(f"rotary positions need an even head size, got {d_head}")
        inv_freq = base ** (-torch.arange(0, d_head, 2, dtype=torch.float) / d_head)
        angles = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq  # (positions, d_head / 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """x: (batch, heads, len, d_head), the tokens at positions offset, offset + 1, ..."""
        cos = self.cos[offset : offset + x.size(2)].to(x.dtype)
        sin = self.sin[offset : offset + x.size(2)].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]  # the pairs (x_2i, x_2i+1)
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class MultiHeadAttention(nn.Module):
    """Project with W_q, W_k, W_v, split into heads, attend per head, merge, project with W_o.

    With n_kv_heads < n_heads, keys and values have fewer heads than queries (GQA; MQA at 1).
    `state`, a dict owned by the caller, makes decoding incremental: self-attention appends this
    step's keys/values to it, cross-attention (static_kv=True) computes them once and reuses them.

    The forward pass is four steps that the variants in attention_variants.py override one at a
    time: `split_heads` (how features become heads), `attend` (scores -> weights -> values),
    `combine_heads` (how head outputs are weighted before W_o) and the optional `rotary`.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        dropout: float,
        bias: bool,
        rotary: Rotary | None = None,
        head_size: int | None = None,
    ):
        """head_size: the features each head attends with; d_model / n_heads unless a variant widens it."""
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_head = n_heads, n_kv_heads, d_model // n_heads
        self.head_size = head_size or self.d_head
        self.dropout = dropout
        self.rotary = rotary
        self.w_q = Linear(d_model, n_heads * self.d_head, bias=bias)
        self.w_k = Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.w_v = Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.w_o = Linear(n_heads * self.head_size, d_model, bias=bias)
        self.head_mask: Tensor | None = None  # (n_heads,) scales each head's output; see Transformer.set_head_mask
        for linear in (self.w_q, self.w_k, self.w_v, self.w_o):
            nn.init.xavier_uniform_(linear.weight)
            if bias:
                nn.init.zeros_(linear.bias)

    def split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        """(batch, len, n_heads * d_head) -> (batch, n_heads, len, head_size)"""
        return x.unflatten(-1, (n_heads, self.d_head)).transpose(1, 2)

    def project(self, query: Tensor, source: Tensor, state: dict | None, static_kv: bool) -> tuple[Tensor, ...]:
        """The projections query W_q, source W_k, source W_v, as (batch, len, features) tensors;
        keys and values are None when the state already holds them (cross-attention, later steps).

        (One product with the three weights concatenated was measured as no faster on CPU, within
        +-3% at the small and base sizes, in training and in decoding steps with the stacked weight
        packed for oneDNN, fp32 and bf16, so the three products stay separate and plain.)"""
        if state is not None and static_kv and "k" in state:
            return self.w_q(query), None, None
        return self.w_q(query), self.w_k(source), self.w_v(source)

    def keys_values(
        self, k: Tensor | None, v: Tensor | None, state: dict | None, static_kv: bool, offset: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Projected keys and values -> (batch, kv_heads, k_len, head_size), with the cache applied."""
        if k is None:
            return state["k"], state["v"]
        k, v = self.split_heads(k, self.n_kv_heads), self.split_heads(v, self.n_kv_heads)
        if self.rotary is not None:
            k = self.rotary(k, offset)  # the cache holds rotated keys, so each is rotated once
        if state is not None and static_kv:
            # Stored contiguous, once: as views of the projections, the batched products of every
            # later step would copy them again to fold batch and heads together. In fp32 for
            # bf16 on CPU (FP32_CROSS).
            dtype = torch.float32 if FP32_CROSS and k.dtype == torch.bfloat16 and k.is_cpu else k.dtype
            k = k.to(dtype, memory_format=torch.contiguous_format)
            v = v.to(dtype, memory_format=torch.contiguous_format)
            state["k"], state["v"] = k, v
        elif state is not None:  # self-attention: this step's keys and values join the earlier ones
            k, v = cache.append(state, "k", k, dim=2), cache.append(state, "v", v, dim=2)
        return k, v

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        need_weights: bool,
        query: Tensor,
        source: Tensor,
        state: dict | None,
        static_kv: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Per-head attention: (batch, heads, q_len, head_size) outputs and, if asked, the weights.
        query and source (the layer inputs) and the state are there for variants that need them."""
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            return attention_with_weights(q, k, v, mask, dropout_p)
        if mask is None and state is not None and not static_kv and k.dtype == torch.bfloat16 and k.is_cpu:
            k, v, mask = whole_cache(state, k, v)
        if q.dtype != k.dtype:  # cross-attention from the fp32 cache (FP32_CROSS), in fp32
            with torch.autocast("cpu", enabled=False):
                return fast_attention(q.to(k.dtype), k, v, mask, dropout_p).to(q.dtype), None
        return fast_attention(q, k, v, mask, dropout_p), None

    def combine_heads(self, out: Tensor, query: Tensor) -> Tensor:
        """Weight each head's output (1 for all in standard attention; see head_mask), then merge:
        (batch, heads, q_len, head_size) -> (batch, q_len, heads * head_size)."""
        if self.head_mask is not None:
            out = out * self.head_mask.to(out.dtype).view(1, -1, 1, 1)
        return out.transpose(1, 2).flatten(2)

    def forward(
        self,
        query: Tensor,
        source: Tensor,
        mask: Tensor | None,
        state: dict | None = None,
        static_kv: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """query: (batch, q_len, d_model); source: (batch, k_len, d_model), the keys' and values' input."""
        offset = state["k"].size(2) if state is not None and not static_kv and "k" in state else 0
        q, k, v = self.project(query, source, state, static_kv)
        q = self.split_heads(q, self.n_heads)  # (batch, heads, q_len, head_size)
        if self.rotary is not None:
            q = self.rotary(q, offset)
        k, v = self.keys_values(k, v, state, static_kv, offset)  # (batch, kv_heads, k_len, head_size)
        out, weights = self.attend(q, k, v, mask, need_weights, query, source, state, static_kv)
        return self.w_o(self.combine_heads(out, query)), weights
