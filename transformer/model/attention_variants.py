"""Multi-head attention variants, each a subclass of MultiHeadAttention that overrides one step.

- MoHAttention (Mixture-of-Head attention, Jin et al. 2024): heads are experts; a router weights
  shared heads and the top-k of the routed heads per token; overrides `combine_heads`.
- DCMHAttention (dynamically composable multi-head attention, Xiao et al. 2024): the heads'
  scores and weights are mixed across heads, statically and per query/key; overrides `attend`.
- OverlappingHeadsAttention (MOHSA, Zhang et al. 2024): each head also sees part of its
  neighbours' features; overrides `split_heads`.

`build_attention` picks one from the model config (model.attention.kind). At their neutral
settings (all MoH heads shared, identity DCMHA mixing with zero dynamic terms, overlap 0) each
computes exactly what MultiHeadAttention computes with the same W_q, W_k, W_v, W_o.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import MultiHeadAttention, Rotary, expand_kv_heads
from .cache import KeyValueCache


@dataclass
class AttentionConfig:
    kind: str = "standard"  # a name in VARIANTS: standard | moh | dcmha | overlap
    shared_heads: int = 1  # moh: heads every token uses
    top_k: int = 2  # moh: routed heads each token picks, besides the shared ones
    balance_weight: float = 0.01  # moh: beta, the load-balancing loss's weight in the training loss
    rank: int = 2  # dcmha: rank R of the query- and key-dependent head mixing (1 or 2)
    overlap: int = 16  # overlap: features each head takes from each neighbour (0 = standard attention)

    def check(self, n_heads: int, d_head: int) -> None:
        if self.kind not in VARIANTS:
            raise ValueError(f"model.attention.kind={self.kind!r} is not one of {tuple(VARIANTS)}")
        self.check_ranges()
        VARIANTS[self.kind].check(self, n_heads, d_head)

    def check_ranges(self) -> None:
        """Each field's range whatever the kind (the unused kinds' keys stay in every config)."""
        for key in ("shared_heads", "top_k", "rank"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.attention.{key}={getattr(self, key)} must be >= 1")
        if self.overlap < 0:
            raise ValueError(f"model.attention.overlap={self.overlap} must be >= 0")
        if not 0 <= self.balance_weight < math.inf:
            raise ValueError(f"model.attention.balance_weight={self.balance_weight} must be >= 0 and finite")


# --- The registry ---------------------------------------------------------------------------------


@dataclass
class Variant:
    """An attention kind: its class, the AttentionConfig fields its constructor takes, and a check
    of those fields against the model's head count and head size (raising ValueError)."""

    cls: type[MultiHeadAttention]
    options: tuple[str, ...] = ()
    check: Callable[[AttentionConfig, int, int], None] = lambda cfg, n_heads, d_head: None


VARIANTS: dict[str, Variant] = {}  # model.attention.kind -> Variant


def register(kind: str, options: tuple[str, ...] = (), check=None):
    """Class decorator: make an attention class available as model.attention.kind=`kind`."""

    def add(cls):
        VARIANTS[kind] = Variant(cls, options, check or Variant.check)
        return cls

    return add


register("standard")(MultiHeadAttention)


def build_attention(cfg, cross: bool, rotary: Rotary | None) -> MultiHeadAttention:
    """The attention module of model config `cfg` (a ModelConfig); rotary positions only where
    queries and keys share a sequence (cross=False)."""
    variant = VARIANTS[cfg.attention.kind]
    options = {name: getattr(cfg.attention, name) for name in variant.options}
    common = dict(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads, dropout=cfg.attention_dropout, bias=cfg.bias)  # fmt: skip
    return variant.cls(**common, **options, rotary=None if cross else rotary)


def check_moh(cfg: AttentionConfig, n_heads: int, d_head: int) -> None:
    routed = n_heads - cfg.shared_heads
    if not 1 <= cfg.shared_heads <= n_heads:
        raise ValueError(f"model.attention.shared_heads={cfg.shared_heads} must be in 1..{n_heads}")
    if routed and not 1 <= cfg.top_k <= routed:
        raise ValueError(f"model.attention.top_k={cfg.top_k} must be in 1..{routed} (the routed heads)")


def check_dcmha(cfg: AttentionConfig, n_heads: int, d_head: int) -> None:
    if not 1 <= cfg.rank <= 2:
        raise ValueError(f"model.attention.rank={cfg.rank} must be 1 or 2")


def check_overlap(cfg: AttentionConfig, n_heads: int, d_head: int) -> None:
    if not 0 <= cfg.overlap <= d_head:
        raise ValueError(f"model.attention.overlap={cfg.overlap} must be in 0..{d_head} (the head size)")


# --- Mixture-of-Head attention ------------------------------------------------------------------


@register("moh", options=("shared_heads", "top_k"), check=check_moh)
class MoHAttention(MultiHeadAttention):
    """Heads as experts. Per token, with router logits r = x W_r (one per head):

        shared heads:  g_i = 2 a_1 * n_shared * softmax(r_shared)_i          (always active)
        routed heads:  g_i = 2 a_2 * top_k * p_i / sum_{j in top-k} p_j       for the top-k of
                       p = softmax(r_routed), 0 for the others
        [a_1, a_2] = softmax(x W_a)   (two-stage routing: shared against routed)

    and the output is W_o applied to the heads' outputs scaled by g. A zero router gives every
    active head weight 1. With every head shared there is nothing to route: g = 1 and this is
    standard attention.
    During training `balance_loss` holds the load-balancing loss of the last forward pass.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, dropout: float, bias: bool, shared_heads: int, top_k: int, rotary=None):  # fmt: skip
        super().__init__(d_model, n_heads, n_kv_heads, dropout, bias, rotary)
        self.n_shared, self.n_routed = shared_heads, n_heads - shared_heads
        self.top_k = top_k if self.n_routed else 0
        self.router = nn.Linear(d_model, n_heads, bias=False)
        self.stage = nn.Linear(d_model, 2, bias=False)  # shared vs routed
        nn.init.zeros_(self.router.weight)
        nn.init.zeros_(self.stage.weight)
        self.balance_loss: Tensor | None = None

    @property
    def active_fraction(self) -> float:
        """The fraction of heads that compute each token's output."""
        return (self.n_shared + self.top_k) / self.n_heads

    def head_gates(self, query: Tensor) -> Tensor:
        """(batch, q_len, d_model) -> g, (batch, q_len, heads)."""
        if not self.n_routed:  # nothing to route: every head counts fully, as in standard attention
            return query.new_ones(query.shape[:-1] + (self.n_heads,), dtype=torch.float)
        logits = self.router(query).float()
        gates = self.n_shared * logits[..., : self.n_shared].softmax(-1)
        a_shared, a_routed = (2 * self.stage(query).float().softmax(-1)).unbind(-1)
        probs = logits[..., self.n_shared :].softmax(-1)  # (batch, q_len, routed)
        top = probs.topk(self.top_k, dim=-1).indices
        chosen = torch.zeros_like(probs).scatter(-1, top, 1.0)
        routed = self.top_k * probs * chosen / (probs * chosen).sum(-1, keepdim=True)
        if self.training:
            self.balance_loss = balance_loss(probs, chosen)
        return torch.cat([a_shared[..., None] * gates, a_routed[..., None] * routed], dim=-1)

    def combine_heads(self, out: Tensor, query: Tensor) -> Tensor:
        gates = self.head_gates(query).to(out.dtype)  # (batch, q_len, heads)
        return super().combine_heads(out * gates.transpose(1, 2)[..., None], query)


def balance_loss(probs: Tensor, chosen: Tensor) -> Tensor:
    """Load balancing over routed heads: n * sum_i f_i P_i, where P_i is the mean router
    probability of head i and f_i the fraction of its selections (both over tokens, f summing
    to 1). It is 1 when routing is uniform and larger when a few heads take most tokens.

    probs, chosen: (..., routed heads); chosen is 1 where a token selected the head."""
    n = probs.size(-1)
    p = probs.reshape(-1, n).mean(0)
    f = chosen.reshape(-1, n).sum(0) / chosen.sum()
    return n * (f * p).sum()


# --- Dynamically composable multi-head attention -------------------------------------------------


class HeadComposition(nn.Module):
    """Mix an attention tensor a, (batch, heads, q_len, k_len), across heads:

        a'_h = sum_g a_g W_gh                                   static mixing (W starts at I)
             + sum_r (sum_g a_g Q1_gr(t)) Q2_rh(t)               query-wise, rank R
             + sum_r (sum_g a_g K1_gr(s)) K2_rh(s)               key-wise, rank R
             + a_h tanh(Qg_h(t)) + a_h tanh(Kg_h(s))             query- and key-wise gates

    where t is the query position and s the key position. The dynamic weights Q1, Q2, Qg (and
    K1, K2, Kg) are computed from the layer input at that position by `DynamicWeights`.
    """

    def __init__(self, n_heads: int, rank: int):
        super().__init__()
        self.n_heads, self.rank = n_heads, rank
        self.static = nn.Parameter(torch.eye(n_heads))

    @property
    def n_dynamic(self) -> int:
        """Dynamic weights per position and side: W1 (heads x rank), W2 (rank x heads), a gate per head."""
        return 2 * self.n_heads * self.rank + self.n_heads

    def split(self, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h, r = self.n_heads, self.rank
        w1, w2, gate = w.split([h * r, r * h, h], dim=-1)
        return w1.unflatten(-1, (h, r)), w2.unflatten(-1, (r, h)), torch.tanh(gate)

    def forward(self, a: Tensor, query_w: Tensor, key_w: Tensor) -> Tensor:
        """a: (batch, heads, q_len, k_len); query_w: (batch, q_len, n_dynamic); key_w: (batch, k_len, n_dynamic)."""
        out = torch.einsum("bgts,gh->bhts", a, self.static.to(a.dtype))
        q1, q2, q_gate = self.split(query_w.to(a.dtype))
        k1, k2, k_gate = self.split(key_w.to(a.dtype))
        out = out + torch.einsum("brts,btrh->bhts", torch.einsum("bgts,btgr->brts", a, q1), q2)
        out = out + torch.einsum("brts,bsrh->bhts", torch.einsum("bgts,bsgr->brts", a, k1), k2)
        return out + a * (q_gate.transpose(1, 2)[..., None] + k_gate.transpose(1, 2)[:, :, None, :])


class DynamicWeights(nn.Module):
    """x -> GELU(x W_1) W_2: one position's dynamic weights for both compositions (scores and
    weights). W_2's columns for the second factors and the gates start at zero, so a new layer
    composes nothing beyond the static identity, yet every part receives gradients."""

    def __init__(self, d_model: int, composition: HeadComposition):
        super().__init__()
        self.n = composition.n_dynamic
        hidden = 2 * self.n
        self.hidden, self.out = nn.Linear(d_model, hidden, bias=False), nn.Linear(hidden, 2 * self.n, bias=False)
        nn.init.normal_(self.hidden.weight, std=d_model**-0.5)
        nn.init.normal_(self.out.weight, std=hidden**-0.5)
        h, r = composition.n_heads, composition.rank
        with torch.no_grad():
            for start in (0, self.n):  # in each composition's block: zero W2 and the gates
                self.out.weight[start + h * r : start + self.n].zero_()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(batch, len, d_model) -> the weights for the score and the probability compositions."""
        return self.out(F.gelu(self.hidden(x))).split(self.n, dim=-1)


@register("dcmha", options=("rank",), check=check_dcmha)
class DCMHAttention(MultiHeadAttention):
    """Attention whose scores (before softmax) and weights (after softmax) are each composed
    across heads by a HeadComposition. It needs the explicit (batch, heads, q_len, k_len)
    scores, so it cannot use the fused scaled_dot_product_attention kernel.

    For the key-wise terms the keys' dynamic weights are cached beside the keys and values.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, dropout: float, bias: bool, rank: int, rotary=None):  # fmt: skip
        super().__init__(d_model, n_heads, n_kv_heads, dropout, bias, rotary)
        self.pre, self.post = HeadComposition(n_heads, rank), HeadComposition(n_heads, rank)
        self.query_weights = DynamicWeights(d_model, self.pre)
        self.key_weights = DynamicWeights(d_model, self.pre)

    def key_dynamic(self, source: Tensor, cache: KeyValueCache | None, static_kv: bool) -> Tensor:
        """The keys' dynamic weights (batch, k_len, 2 * n_dynamic), cached like the keys (in the
        cache's `extra`)."""
        cached = None if cache is None else cache.extra.get("key_w")
        if static_kv and cached is not None:
            return cached
        key_w = torch.cat(self.key_weights(source), dim=-1)
        if cached is not None:
            key_w = torch.cat([cached, key_w], dim=1)
        if cache is not None:
            cache.extra["key_w"] = key_w
        return key_w

    def attend(self, q, k, v, mask, need_weights, query, source, cache, static_kv):
        k, v = expand_kv_heads(q, k, v)
        q_pre, q_post = self.query_weights(query)
        key_w = self.key_dynamic(source, cache, static_kv)
        if key_w.size(0) != q.size(0):  # beam search, as in MultiHeadAttention.forward
            key_w = key_w.repeat_interleave(q.size(0) // key_w.size(0), dim=0)
        k_pre, k_post = key_w.split(self.pre.n_dynamic, dim=-1)
        scores = self.pre(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), q_pre, k_pre)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = self.post(scores.softmax(dim=-1), q_post, k_post)
        dropout_p = self.dropout if self.training else 0.0
        return F.dropout(weights, dropout_p) @ v, weights if need_weights else None


# --- Overlapping heads -----------------------------------------------------------------------------


@register("overlap", options=("overlap",), check=check_overlap)
class OverlappingHeadsAttention(MultiHeadAttention):
    """Head i attends with features [i*d - o, (i+1)*d + o) of the projected queries, keys and
    values (zero beyond the ends), d = d_model / heads, o = overlap: each head shares o features
    with each neighbour. Heads are d + 2o wide, so W_o maps heads * (d + 2o) back to d_model.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, dropout: float, bias: bool, overlap: int, rotary=None):  # fmt: skip
        super().__init__(
            d_model, n_heads, n_kv_heads, dropout, bias, rotary, head_size=d_model // n_heads + 2 * overlap
        )
        self.overlap = overlap

    def split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        """(batch, len, n_heads * d) -> (batch, n_heads, len, d + 2 * overlap)"""
        if not self.overlap:
            return super().split_heads(x, n_heads)
        x = F.pad(x, (self.overlap, self.overlap))
        return x.unfold(-1, self.head_size, self.d_head).transpose(1, 2)
