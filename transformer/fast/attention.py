"""Attention for CPUs: MultiHeadAttention's kernel.

- `fast_attention`: F.scaled_dot_product_attention, except where two batched products
  (`product_attention`) are faster on a CPU: bf16 training, and inference with few queries
  (a decoding step) or, in bf16, short keys.
- Under bf16 on a CPU a decoding step attends to the self-attention cache's whole buffers, the
  slots past its tokens masked (FastKeyValueCache.whole): they are read in place.
- Attention to a cache kept in fp32 under bf16 (the encoder's keys and values with
  runtime.fp32_cross, fast/cache.py) runs in fp32.

The caches themselves (growing in place, or paged) are cache objects (fast/cache.py,
fast/paged.py); folding a sentence's beams into one cross-attention query is FastDecoderLayer's
(fast/model.py).

Each computes what the reference computes; tests/test_fast.py checks them against it.
docs/PERFORMANCE.md has what each is worth and where it was measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.attention import MultiHeadAttention, expand_kv_heads, scaled_dot_product_attention
from .cache import FastKeyValueCache


def fast_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    """F.scaled_dot_product_attention with grouped-query support, or on a CPU the two batched
    products of `product_attention` where those are faster; same shapes as the reference."""
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


class FastMultiHeadAttention(MultiHeadAttention):
    """MultiHeadAttention with `fast_attention` as its kernel, attending in fp32 to a cache kept
    in fp32 (the encoder's keys and values under bf16 with runtime.fp32_cross; fast/cache.py).
    A variant (attention_variants.py) gets a class derived from this one and itself, which keeps
    every step the variant overrides (transformer/fast/__init__.py: `fast_class`)."""

    def attend(self, q, k, v, mask, need_weights, query, source, cache, static_kv):
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            return scaled_dot_product_attention(q, k, v, mask, dropout_p)
        if mask is None and isinstance(cache, FastKeyValueCache) and not static_kv and k.dtype == torch.bfloat16 and k.is_cpu:  # fmt: skip
            k, v, mask = cache.whole()  # read in place (FastKeyValueCache.whole)
        if q.dtype != k.dtype:  # cross-attention from the fp32 cache, in fp32
            with torch.autocast("cpu", enabled=False):
                return fast_attention(q.to(k.dtype), k, v, mask, dropout_p).to(q.dtype), None
        return fast_attention(q, k, v, mask, dropout_p), None
