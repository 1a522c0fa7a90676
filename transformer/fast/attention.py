"""Attention for CPUs (replaces MultiHeadAttention's kernel, cache handling and cross-attention).

- `fast_attention`: F.scaled_dot_product_attention, except where two batched products
  (`product_attention`) are faster on a CPU: bf16 training, and inference with few queries
  (a decoding step) or, in bf16, short keys.
- Keys and values of self-attention grow in place (fast/cache.py). Under bf16 on a CPU, a step
  attends to the cache's whole buffer with a mask over the unfilled slots (`whole_cache`): the
  batched product copies a narrowed view of the buffer, not the buffer itself.
- Cross-attention keys and values are stored contiguous, once, and under bf16 on a CPU in fp32
  (runtime.fp32_cross), where the product at a decoding step's shapes is faster.
- Beam search's k rows per sentence fold into one longer query per sentence
  (`attend_memory_folded`), so the memory's keys and values are computed, cached and read once per
  sentence instead of being repeated per beam.

Each computes what the reference computes; tests/test_fast.py checks them against it.
docs/PERFORMANCE.md has what each is worth and where it was measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import MultiHeadAttention, expand_kv_heads, scaled_dot_product_attention
from . import cache


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


def whole_cache(state: dict, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """A decoding step's self-attention keys and values as the cache's whole buffers, with a mask
    that hides the slots past the tokens so far: (k, v, mask), or the arguments unchanged (no mask)
    when the cache holds no growing buffers.

    For bf16 on CPU torch's batched product copies an operand whose batches are not packed one
    after the other, and the cached keys and values, a narrowed view of a longer buffer, are not.
    The whole buffer is, so the products read it in place, with the same result, although they
    score up to twice the keys. In fp32 the product reads the view in place, so this is for bf16."""
    keys, values = cache.whole(state, "k"), cache.whole(state, "v")
    if keys is None or values is None:
        return k, v, None
    (k_buffer, filled), (v_buffer, _) = keys, values
    if filled == k_buffer.size(2):  # full: the view is the buffer
        return k, v, None
    mask = torch.arange(k_buffer.size(2), device=k.device) < filled
    return k_buffer, v_buffer, mask.view(1, 1, 1, -1)


def cross_dtype(attn, x: Tensor) -> torch.dtype:
    """The dtype cross-attention keys and values are kept and attended in for an `x` of the step:
    fp32 under bf16 on a CPU where runtime.fp32_cross asks for it (`attn.fp32_cross`), else x's."""
    fp32 = getattr(attn, "fp32_cross", False) and x.dtype == torch.bfloat16 and x.is_cpu
    return torch.float32 if fp32 else x.dtype


class FastMultiHeadAttention(MultiHeadAttention):
    """MultiHeadAttention with `fast_attention` as its kernel, growing self-attention caches,
    contiguous cross-attention caches (in fp32 under bf16 on a CPU, with runtime.fp32_cross) and
    attention from the whole cache buffer under bf16 on a CPU. A variant (attention_variants.py)
    gets a class derived from this one and itself, which keeps every step the variant overrides
    (transformer/fast/__init__.py: `fast_class`)."""

    def adopt(self, runtime) -> None:
        self.kernel, self.fp32_cross = fast_attention, runtime.fp32_cross

    def keys_values(self, k: Tensor | None, v: Tensor | None, state: dict | None, static_kv: bool, offset: int = 0):
        if k is None:
            return state["k"], state["v"]
        k, v = self.split_heads(k, self.n_kv_heads), self.split_heads(v, self.n_kv_heads)
        if self.rotary is not None:
            k = self.rotary(k, offset)
        if state is not None and static_kv:
            # Contiguous, once: as views of the projections, the batched products of every later
            # step would copy them again to fold batch and heads together.
            dtype = cross_dtype(self, k)
            # (`.to(memory_format=...)` would hand the view back unchanged when the dtype matches.)
            k, v = k.to(dtype).contiguous(), v.to(dtype).contiguous()
            state["k"], state["v"] = k, v
        elif state is not None:
            k, v = cache.append(state, "k", k, dim=2), cache.append(state, "v", v, dim=2)
        return k, v

    def attend(self, q, k, v, mask, need_weights, query, source, state, static_kv):
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            return scaled_dot_product_attention(q, k, v, mask, dropout_p)
        if mask is None and state is not None and not static_kv and k.dtype == torch.bfloat16 and k.is_cpu:
            k, v, mask = whole_cache(state, k, v)
        if q.dtype != k.dtype:  # cross-attention from the fp32 cache, in fp32
            with torch.autocast("cpu", enabled=False):
                return fast_attention(q.to(k.dtype), k, v, mask, dropout_p).to(q.dtype), None
        return fast_attention(q, k, v, mask, dropout_p), None


def attend_memory_folded(self, query: Tensor, memory: Tensor, src_mask: Tensor, state: dict | None, need_weights: bool):
    """DecoderLayer.attend_memory with each sentence's rows (beam search's k beams, consecutive)
    folded into one longer query: every query attends on its own, so the result is the same, and
    the source-side keys and values are computed, cached and read once per sentence."""
    attn, group = self.cross_attn, query.size(0) // memory.size(0)
    if group == 1:
        return attn(query, memory, src_mask, state, static_kv=True, need_weights=need_weights)
    if group * memory.size(0) != query.size(0):
        raise ValueError(f"{query.size(0)} target rows do not divide into {memory.size(0)} sentences")
    rows, length = query.shape[:2]
    out, weights = attn(query.reshape(memory.size(0), group * length, -1), memory, src_mask, state, True, need_weights)
    if weights is not None:  # (sentences, heads, group * len, src_len) -> (rows, heads, len, src_len)
        weights = weights.unflatten(2, (group, length)).transpose(1, 2).flatten(0, 1)
    return out.reshape(rows, length, -1), weights
