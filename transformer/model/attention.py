"""Attention: scaled dot-product attention and multi-head attention (W_q, W_k, W_v, W_o).

Shapes: queries (batch, heads, q_len, d_head); keys and values (batch, kv_heads, k_len, d_head);
a mask, True where a query may attend to a key, broadcasts to (batch, heads, q_len, k_len).
The variants (attention_variants.py) override one step of MultiHeadAttention each.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .blocks import rows_at
from .cache import KeyValueCache, consecutive_rows


def expand_kv_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Grouped-query: repeat each key/value head for the group of query heads it serves."""
    if k.size(1) == q.size(1):
        return k, v
    group = q.size(1) // k.size(1)
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float):
    """Attention(Q, K, V) = softmax(QK^T / sqrt(d_head)) V, written out; returns the weights too.

    q: (batch, heads, q_len, d_head); k, v: (batch, kv_heads, k_len, d_head)."""
    k, v = expand_kv_heads(q, k, v)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (batch, heads, q_len, k_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    return F.dropout(weights, dropout_p) @ v, weights


def fused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    """The same attention by torch's one fused kernel, without the weights; same shapes."""
    gqa = k.size(1) != q.size(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


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

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """x: (batch, heads, len, d_head), the tokens at positions offset, offset + 1, ...; offset
        is one int for every row, or a (batch,) tensor, each row's own (a paged cache's rows)."""
        cos, sin = rows_at(self.cos, offset, x.size(2)), rows_at(self.sin, offset, x.size(2))
        if cos.dim() == 3:  # (batch, len, d_head / 2): one angle per row, the same for every head
            cos, sin = cos[:, None], sin[:, None]
        return self.turn(x, cos.to(x.dtype), sin.to(x.dtype))

    def turn(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Each feature pair of x turned by the angles whose cosines and sines are cos and sin
        (d_head / 2 per position, broadcast over x's leading dimensions)."""
        x1, x2 = x[..., 0::2], x[..., 1::2]  # the pairs (x_2i, x_2i+1)
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class MultiHeadAttention(nn.Module):
    """Project with W_q, W_k, W_v, split into heads, attend per head, merge, project with W_o.

    With n_kv_heads < n_heads, keys and values have fewer heads than queries (GQA; MQA at 1).
    `cache`, a KeyValueCache owned by the caller, makes decoding incremental: self-attention
    appends this step's keys/values to it, cross-attention (static_kv=True) computes them once
    and reuses them.

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
        self.w_q = nn.Linear(d_model, n_heads * self.d_head, bias=bias)
        self.w_k = nn.Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.w_v = nn.Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.w_o = nn.Linear(n_heads * self.head_size, d_model, bias=bias)
        self.head_mask: Tensor | None = None  # (n_heads,) scales each head's output; see Transformer.set_head_mask
        for linear in (self.w_q, self.w_k, self.w_v, self.w_o):
            nn.init.xavier_uniform_(linear.weight)
            if bias:
                nn.init.zeros_(linear.bias)

    def split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        """(batch, len, n_heads * d_head) -> (batch, n_heads, len, d_head)"""
        return x.unflatten(-1, (n_heads, self.d_head)).transpose(1, 2)

    def project(self, query: Tensor, source: Tensor, cache: KeyValueCache | None, static_kv: bool) -> tuple[Tensor, ...]:  # fmt: skip
        """The projections query W_q, source W_k, source W_v, as (batch, len, features) tensors;
        keys and values are None when the cache already holds them (cross-attention, later steps)."""
        if cache is not None and static_kv and cache.memory() is not None:
            return self.w_q(query), None, None
        return self.w_q(query), self.w_k(source), self.w_v(source)

    def keys_values(
        self, k: Tensor | None, v: Tensor | None, cache: KeyValueCache | None, static_kv: bool, offset: int | Tensor = 0
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Projected keys and values -> (batch, kv_heads, k_len, head_size), with the cache applied,
        and the cache's mask over them (None: every slot is a token)."""
        if k is None:
            return *cache.memory(), None
        k, v = self.split_heads(k, self.n_kv_heads), self.split_heads(v, self.n_kv_heads)
        if self.rotary is not None:
            k = self.rotary(k, offset)  # the cache holds rotated keys, so each is rotated once
        if cache is None:
            return k, v, None
        if static_kv:
            return *cache.store(k, v), None
        return cache.append(k, v)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        need_weights: bool,
        query: Tensor,
        source: Tensor,
        cache: KeyValueCache | None,
        static_kv: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Per-head attention: (batch, heads, q_len, head_size) outputs and, if asked, the weights.
        query and source (the layer inputs) and the cache are there for variants that need them."""
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            return scaled_dot_product_attention(q, k, v, mask, dropout_p)
        return fused_attention(q, k, v, mask, dropout_p), None

    def combine_heads(self, out: Tensor, query: Tensor) -> Tensor:
        """Weight each head's output (1 for all in standard attention; see head_mask), then merge:
        (batch, heads, q_len, head_size) -> (batch, q_len, heads * head_size)."""
        if self.head_mask is not None:
            out = out * self.head_mask.to(out.dtype).view(1, -1, 1, 1)
        return out.transpose(1, 2).flatten(2)

    def forward(
        self,
        query: Tensor,
        source: Tensor | None,
        mask: Tensor | None,
        cache: KeyValueCache | None = None,
        static_kv: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """query: (batch, q_len, d_model); source: (batch, k_len, d_model), the keys' and values'
        input (None when the cache holds the encoder's already)."""
        offset = cache.positions() if cache is not None and not static_kv else 0
        q, k, v = self.project(query, source, cache, static_kv)
        q = self.split_heads(q, self.n_heads)  # (batch, heads, q_len, head_size)
        if self.rotary is not None:
            q = self.rotary(q, offset)
        k, v, slots = self.keys_values(k, v, cache, static_kv, offset)  # (batch, kv_heads, k_len, head_size)
        if slots is not None:  # the cache's slots that hold no token of a row
            mask = slots if mask is None else mask & slots
        if k.size(0) != q.size(0):  # each sentence's rows (beam search's beams) read its one row of memory
            rows = consecutive_rows(q.size(0), k.size(0), q.device) if cache is None else cache.sentence_rows(q.size(0), k.size(0))  # fmt: skip
            k, v, mask = (None if t is None else t.index_select(0, rows) for t in (k, v, mask))
        out, weights = self.attend(q, k, v, mask, need_weights, query, source, cache, static_kv)
        return self.w_o(self.combine_heads(out, query)), weights
