"""Pictures of attention: one grid of heatmaps (a panel per head) per layer and attention kind, as
the trainer writes them to TensorBoard (transformer/analysis/plotting.py draws per-head scores)."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # files and TensorBoard only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from .model import Transformer  # noqa: E402

KIND_TITLES = {
    "encoder_self": "encoder self-attention",
    "decoder_self": "decoder self-attention",
    "cross": "cross-attention",
}


def attention_grid(weights: Tensor, query_tokens: list[str], key_tokens: list[str], title: str):
    """weights: (heads, query_len, key_len) -> a figure with one heatmap per head, tokens on the axes."""
    heads = weights.size(0)
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    size = 1.2 + 0.18 * max(len(query_tokens), len(key_tokens))
    fig, axes = plt.subplots(rows, cols, figsize=(cols * size, rows * size), squeeze=False)
    for head, ax in enumerate(axes.flat):
        if head >= heads:
            ax.axis("off")
            continue
        ax.imshow(weights[head].float().cpu().numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(f"head {head}", fontsize=8)
        ax.set_xticks(range(len(key_tokens)), key_tokens, rotation=90, fontsize=6)
        ax.set_yticks(range(len(query_tokens)), query_tokens, fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


@torch.no_grad()
def attention_figures(model: Transformer, tokenizer, src_ids: list[int], tgt_ids: list[int]) -> dict[str, object]:
    """Figures for every layer and kind, for one sentence pair (target without BOS/EOS).

    Keys are "<kind>/layer<i>"; the decoder reads BOS + target, the encoder source + EOS.
    """
    device = next(model.parameters()).device
    src = torch.tensor([src_ids + [tokenizer.eos_id]], device=device)
    tgt = torch.tensor([[tokenizer.bos_id] + tgt_ids], device=device)
    model.eval()
    weights = model.attention_weights(src, tgt)
    src_tokens = [tokenizer.source.id_to_piece(i) for i in src_ids] + ["</s>"]
    tgt_tokens = ["<s>"] + [tokenizer.id_to_piece(i) for i in tgt_ids]
    axes = {
        "encoder_self": (src_tokens, src_tokens),
        "decoder_self": (tgt_tokens, tgt_tokens),
        "cross": (tgt_tokens, src_tokens),
    }
    figures = {}
    for kind, layers in weights.items():
        queries, keys = axes[kind]
        for i, w in enumerate(layers):
            figures[f"{kind}/layer{i}"] = attention_grid(w[0], queries, keys, f"{KIND_TITLES[kind]}, layer {i}")
    return figures
