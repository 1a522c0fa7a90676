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
from torch.nn.attention import SDPBackend, sdpa_kernel


def attention_with_weights(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float):
    """The explicit softmax(QK^T / sqrt(d_head)) V, returning the weights too (for inspection).

    q: (batch, heads, q_len, d_head); k, v: (batch, kv_heads, k_len, d_head).
    """
    if k.size(1) != q.size(1):  # grouped-query: each key/value head serves a group of query heads
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (batch, heads, q_len, k_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    return F.dropout(weights, dropout_p) @ v, weights


def fast_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    """F.scaled_dot_product_attention with grouped-query support; same shapes as above.

    On CPU, torch's flash kernel is several times slower than the plain math kernel for bf16
    inputs at translation lengths (measured on torch 2.13), so bf16 on CPU takes the math kernel.
    """
    gqa = k.size(1) != q.size(1)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


class MultiHeadAttention(nn.Module):
    """Project with W_q, W_k, W_v, split into heads, attend per head, merge, project with W_o.

    With n_kv_heads < n_heads, keys and values have fewer heads than queries (GQA; MQA at 1).
    `state`, a dict owned by the caller, makes decoding incremental: self-attention appends this
    step's keys/values to it, cross-attention (static_kv=True) computes them once and reuses them.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, dropout: float, bias: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_head = n_heads, n_kv_heads, d_model // n_heads
        self.dropout = dropout
        self.w_q = nn.Linear(d_model, n_heads * self.d_head, bias=bias)
        self.w_k = nn.Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.w_v = nn.Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.w_o = nn.Linear(n_heads * self.d_head, d_model, bias=bias)
        self.head_mask: Tensor | None = None  # (n_heads,) scales each head's output; see Transformer.set_head_mask
        for linear in (self.w_q, self.w_k, self.w_v, self.w_o):
            nn.init.xavier_uniform_(linear.weight)
            if bias:
                nn.init.zeros_(linear.bias)

    def split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        """(batch, len, n_heads * d_head) -> (batch, n_heads, len, d_head)"""
        return x.unflatten(-1, (n_heads, self.d_head)).transpose(1, 2)

    def keys_values(self, source: Tensor, state: dict | None, static_kv: bool) -> tuple[Tensor, Tensor]:
        if state is not None and static_kv and "k" in state:
            return state["k"], state["v"]
        k = self.split_heads(self.w_k(source), self.n_kv_heads)
        v = self.split_heads(self.w_v(source), self.n_kv_heads)
        if state is not None:
            if not static_kv and "k" in state:
                k, v = torch.cat([state["k"], k], dim=2), torch.cat([state["v"], v], dim=2)
            state["k"], state["v"] = k, v
        return k, v

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
        q = self.split_heads(self.w_q(query), self.n_heads)  # (batch, heads, q_len, d_head)
        k, v = self.keys_values(source, state, static_kv)  # (batch, kv_heads, k_len, d_head)
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = attention_with_weights(q, k, v, mask, dropout_p)
        else:
            out, weights = fast_attention(q, k, v, mask, dropout_p), None
        if self.head_mask is not None:
            out = out * self.head_mask.to(out.dtype).view(1, -1, 1, 1)
        out = out.transpose(1, 2).flatten(2)  # merge heads: (batch, q_len, d_model)
        return self.w_o(out), weights
