"""Per-head scores of the analysis (confidence, importance) as heatmaps: a layer per row, a head per column."""

from __future__ import annotations

from itertools import product

from torch import Tensor

from ..plotting import KIND_TITLES, plt


def head_heatmap(values: dict[str, Tensor], title: str, label: str):
    """values[kind]: (layers, heads) -> one annotated heatmap per attention kind."""
    fig, axes = plt.subplots(1, len(values), figsize=(4.2 * len(values), 3.2), squeeze=False)
    for ax, (kind, grid) in zip(axes.flat, values.items()):
        grid = grid.float().cpu()
        image = ax.imshow(grid.numpy(), cmap="magma", aspect="auto")
        ax.set_title(KIND_TITLES[kind], fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(grid.size(1)))
        ax.set_yticks(range(grid.size(0)))
        for layer, head in product(range(grid.size(0)), range(grid.size(1))):
            value = float(grid[layer, head])
            ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=6, color="white")
        fig.colorbar(image, ax=ax, label=label)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
