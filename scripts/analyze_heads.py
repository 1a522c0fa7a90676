"""Attention-head analysis of a checkpoint: confidence and importance of every head, and pruning.

    python scripts/analyze_heads.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt
    python scripts/analyze_heads.py checkpoint=PATH split=val sentences=300 prune=[4,8,12] output=heads.png

For each head (encoder self-attention, decoder self-attention, cross-attention; every layer) it
prints its confidence (mean of its largest attention weight, Voita et al. 2019) and the BLEU lost
on the split when that head alone is masked at inference; then the BLEU after masking the k least
important heads together, for each k in `prune`. A PNG shows both as heatmaps per layer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from transformer.cli import parse_args
from transformer.config import exit_on_user_error
from transformer.decoding import DecodeConfig


@dataclass
class HeadsConfig:
    checkpoint: str = "???"
    split: str = "val"
    data_dir: Optional[str] = None  # default: the training run's
    sentences: int = 500  # the first N sentences of the split
    prune: list[int] = field(default_factory=lambda: [2, 4, 8])
    output: Optional[str] = None  # PNG; default: next to the checkpoint
    device: str = "cpu"
    decode: DecodeConfig = field(default_factory=lambda: DecodeConfig(strategy="greedy"))


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, HeadsConfig, __doc__)
        from transformer.checkpoint import load_model
        from transformer.data import DataConfig, load_split, tokenize
        from transformer.heads import head_confidence, head_importance, masked_bleu, prune_least_important
        from transformer.plotting import head_heatmap, plt

        model, tokenizer, payload = load_model(Path(cfg.checkpoint), cfg.device)
        data = DataConfig(**payload["train_config"]["data"])
        data.dir = cfg.data_dir or data.dir
        ds = load_split(data, cfg.split)
        corpus = tokenize(ds.select(range(min(cfg.sentences, len(ds)))), tokenizer)
        confidence = head_confidence(model, corpus, tokenizer)
        baseline, drops = head_importance(model, corpus, tokenizer, cfg.decode, cfg.device)
        print(f"{cfg.split}, {len(corpus)} sentences, {cfg.decode.strategy}: BLEU {baseline:.2f} with all heads")
        print(f"{'kind':<14}{'layer':>6}{'head':>6}{'confidence':>12}{'BLEU lost':>11}")
        for kind, grid in drops.items():
            for layer in range(grid.size(0)):
                for head in range(grid.size(1)):
                    print(
                        f"{kind:<14}{layer:>6}{head:>6}{float(confidence[kind][layer, head]):>12.3f}{float(grid[layer, head]):>11.2f}"
                    )
        n_heads = sum(g.numel() for g in drops.values())
        for k in cfg.prune:
            bleu = masked_bleu(model, corpus, tokenizer, cfg.decode, cfg.device, prune_least_important(model, drops, k))
            print(f"pruning the {k} least important of {n_heads} heads: BLEU {bleu:.2f} ({bleu - baseline:+.2f})")
        output = Path(cfg.output) if cfg.output else Path(cfg.checkpoint).with_suffix(".heads.png")
        fig, fig2 = (
            head_heatmap(confidence, "head confidence", "confidence"),
            head_heatmap(drops, "BLEU lost when masked", "BLEU"),
        )
        fig.savefig(output.with_name(output.stem + "_confidence.png"), dpi=120)
        fig2.savefig(output, dpi=120)
        plt.close(fig)
        plt.close(fig2)
        print(f"wrote {output} and {output.with_name(output.stem + '_confidence.png')}")


if __name__ == "__main__":
    main(sys.argv[1:])
