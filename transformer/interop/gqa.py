"""Convert a trained multi-head attention model to grouped-query attention (GQA).

Each group of n_heads / n_kv_heads query heads keeps its own queries but shares one key head and
one value head: the mean of the group's key and value projections (Ainslie et al. 2023).

Mean pooling works best when the heads of a group compute similar keys and values. With
`align=True`, calibration activations are used first to (1) group heads whose keys and values
are most alike, by permuting heads (which changes no output), and (2) rotate each head's key and
value space onto its group's first head by orthogonal Procrustes, compensated in W_q and W_o so
the output is still unchanged; only then are the projections averaged. This follows the idea of
"Align Attention Heads Before Merging Them" (Jin et al. 2024).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import Tensor

from ..model import Transformer, padding_mask
from ..model.attention import MultiHeadAttention


def head_rows(linear: torch.nn.Linear, n_heads: int) -> tuple[Tensor, Tensor | None]:
    """A projection's weight as (heads, d_head, d_model) and its bias as (heads, d_head)."""
    weight = linear.weight.detach().unflatten(0, (n_heads, -1))
    bias = linear.bias.detach().unflatten(0, (n_heads, -1)) if linear.bias is not None else None
    return weight, bias


def head_activations(linear: torch.nn.Linear, n_heads: int, inputs: Tensor) -> Tensor:
    """(tokens, d_model) inputs -> (heads, tokens, d_head) projected features per head."""
    return linear(inputs).detach().unflatten(-1, (n_heads, -1)).transpose(0, 1)


def procrustes(source: Tensor, target: Tensor) -> Tensor:
    """The orthogonal R minimizing ||source R - target|| (both (tokens, d))."""
    u, _, vh = torch.linalg.svd(source.T @ target)
    return u @ vh


def group_heads(keys: Tensor, values: Tensor, group_size: int) -> list[list[int]]:
    """Greedy grouping: each group starts from the lowest unassigned head and takes the heads
    whose keys and values, once rotated onto it, are closest to it."""
    n = keys.size(0)

    def distance(a: int, b: int) -> float:
        total = 0.0
        for x in (keys, values):
            rotated = x[b] @ procrustes(x[b], x[a])
            total += float((rotated - x[a]).norm() / x[a].norm().clamp_min(1e-9))
        return total

    free, groups = list(range(n)), []
    while free:
        seed = free.pop(0)
        nearest = sorted(free, key=lambda b: distance(seed, b))[: group_size - 1]
        free = [h for h in free if h not in nearest]
        groups.append([seed, *sorted(nearest)])
    return groups


@torch.no_grad()
def align_heads(attn: MultiHeadAttention, inputs: Tensor, group_size: int, rotate_keys: bool) -> None:
    """Reorder and rotate the heads of one MHA module in place without changing its output, so
    that consecutive groups of `group_size` heads hold alike keys and values.

    inputs: (tokens, d_model) calibration inputs of the keys and values."""
    h, d = attn.n_heads, attn.d_head
    keys, values = head_activations(attn.w_k, h, inputs), head_activations(attn.w_v, h, inputs)
    groups = group_heads(keys, values, group_size)
    wq, bq = head_rows(attn.w_q, h)
    wk, bk = head_rows(attn.w_k, h)
    wv, bv = head_rows(attn.w_v, h)
    wo = attn.w_o.weight.detach().unflatten(1, (h, d)).transpose(0, 1)  # (heads, d_model, d_head)
    for group in groups:
        seed = group[0]
        for head in group[1:]:
            if rotate_keys:  # q.k is unchanged when queries and keys turn together
                r = procrustes(keys[head], keys[seed])
                wq[head], wk[head] = r.T @ wq[head], r.T @ wk[head]
                if bk is not None:
                    bq[head], bk[head] = bq[head] @ r, bk[head] @ r
            r = procrustes(values[head], values[seed])  # and W_o undoes the values' turn
            wv[head], wo[head] = r.T @ wv[head], wo[head] @ r
            if bv is not None:
                bv[head] = bv[head] @ r
    order = [head for group in groups for head in group]
    for linear, weight, bias in ((attn.w_q, wq, bq), (attn.w_k, wk, bk), (attn.w_v, wv, bv)):
        linear.weight.copy_(weight[order].flatten(0, 1))
        if bias is not None:
            linear.bias.copy_(bias[order].flatten())
    attn.w_o.weight.copy_(wo[order].transpose(0, 1).flatten(1))


@torch.no_grad()
def merge_heads(attn: MultiHeadAttention, n_kv_heads: int) -> None:
    """Mean-pool the key and value projections of consecutive groups of heads in place."""
    h = attn.n_heads
    if attn.n_kv_heads != h:
        raise ValueError(f"the module already has {attn.n_kv_heads} key/value heads for {h} query heads")
    for name in ("w_k", "w_v"):
        weight, bias = head_rows(getattr(attn, name), h)
        pooled_bias = bias.unflatten(0, (n_kv_heads, -1)).mean(1).flatten() if bias is not None else None
        setattr(attn, name, _linear(weight.unflatten(0, (n_kv_heads, -1)).mean(1).flatten(0, 1), pooled_bias))
    attn.n_kv_heads = n_kv_heads


def _linear(weight: Tensor, bias: Tensor | None) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.size(1), weight.size(0), bias=bias is not None)
    linear.weight.data.copy_(weight)
    if bias is not None:
        linear.bias.data.copy_(bias)
    return linear.to(weight.device)


@torch.no_grad()
def calibration_inputs(model: Transformer, batches: list[tuple[Tensor, Tensor]]) -> dict[int, Tensor]:
    """The non-padding key/value inputs each attention module sees on some (src, tgt_in) batches,
    keyed by id(module): (tokens, d_model)."""
    captured: dict[int, list[Tensor]] = {}
    keep: dict[int, Tensor] = {}
    hooks = []

    def hook(module, args):
        source = args[1]
        captured.setdefault(id(module), []).append(source[keep[id(module)]])

    modules = model.attention_modules()
    for attn in _all_attention(model):
        hooks.append(attn.register_forward_pre_hook(hook))
    try:
        model.eval()
        for src, tgt in batches:
            src_keep, tgt_keep = src != model.cfg.pad_id, tgt != model.cfg.pad_id
            for attn in modules["encoder_self"] + modules["cross"]:
                keep[id(attn)] = src_keep
            for attn in modules["decoder_self"]:
                keep[id(attn)] = tgt_keep
            src_mask = padding_mask(src, model.cfg.pad_id)
            # The whole padded batch, which `keep` indexes (encode would split it by length).
            model.decode(tgt, Transformer.encode(model, src, src_mask)[0], src_mask)
    finally:
        for h in hooks:
            h.remove()
    return {key: torch.cat(chunks) for key, chunks in captured.items()}


def convert_to_gqa(
    model: Transformer, n_kv_heads: int, calibration: list[tuple[Tensor, Tensor]] | None = None
) -> Transformer:
    """A copy of `model` with n_kv_heads key/value heads in every attention module; with
    calibration batches, heads are grouped and aligned before merging (see the module doc)."""
    cfg = model.cfg
    if cfg.kv_heads != cfg.n_heads:
        raise ValueError(f"the checkpoint already uses {cfg.kv_heads} key/value heads; convert an MHA model")
    if n_kv_heads < 1 or cfg.n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide the model's {cfg.n_heads} heads")
    if cfg.attention.kind != "standard":
        raise ValueError(f"conversion supports standard attention, not model.attention.kind={cfg.attention.kind}")
    inputs = calibration_inputs(model, calibration) if calibration else {}
    converted = copy.deepcopy(model)
    for original, attn in zip(_all_attention(model), _all_attention(converted)):
        if id(original) in inputs:
            align_heads(attn, inputs[id(original)], cfg.n_heads // n_kv_heads, rotate_keys=cfg.positional != "rope")
        merge_heads(attn, n_kv_heads)
    converted.cfg = dataclasses.replace(cfg, n_kv_heads=n_kv_heads)
    return converted


def _all_attention(model: Transformer) -> list[MultiHeadAttention]:
    return [attn for layers in model.attention_modules().values() for attn in layers]


def kv_cache_bytes_per_token(cfg, bytes_per_value: int = 4) -> dict[str, int]:
    """Decoder key/value cache per token: self-attention per generated token, cross-attention per
    source token (keys and values, every decoder layer)."""
    per_layer = 2 * cfg.kv_heads * cfg.head_size * bytes_per_value
    return {"self_per_target_token": cfg.n_decoder_layers * per_layer, "cross_per_source_token": cfg.n_decoder_layers * per_layer}  # fmt: skip
