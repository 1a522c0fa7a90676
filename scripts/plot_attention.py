"""Heatmaps of every attention head for one sentence, as PNG files.

    python scripts/plot_attention.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt sentence="Ein Hund rennt."
    python scripts/plot_attention.py checkpoint=PATH sentence="..." target="A dog runs." output_dir=attention

The model translates the sentence greedily (or reads `target`) and writes one PNG per attention
kind and layer: encoder self-attention, decoder self-attention and cross-attention, a panel per
head, tokens on the axes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from transformer.cli import parse_args
from transformer.errors import ConfigError, exit_on_user_error
from transformer.files import atomic_open, check_output, writing
from transformer.runtime import RuntimeConfig


@dataclass
class PlotConfig:
    checkpoint: str = "???"
    sentence: str = "???"
    target: Optional[str] = None  # default: the model's own greedy translation
    output_dir: str = "attention"
    device: str = "cpu"


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, PlotConfig, __doc__)
        from transformer.decoding import DecodeConfig
        from transformer.plotting import attention_figures, plt
        from transformer.translator import Translator

        translator = Translator.load(cfg.checkpoint, [], cfg.device, DecodeConfig(strategy="greedy"), RuntimeConfig(fast=False))  # fmt: skip
        model, tokenizer = translator.model, translator.tokenizer
        src_ids = tokenizer.source.encode([cfg.sentence])[0]
        if cfg.target is None:
            tgt_ids = translator.translate_ids([src_ids])[0][0].tokens
        else:
            tgt_ids = tokenizer.encode([cfg.target])[0]
        print(f"target: {tokenizer.decode([tgt_ids])[0]}")
        out = Path(cfg.output_dir)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"output_dir={out} is not a directory")
        with writing(out):
            out.mkdir(parents=True, exist_ok=True)
        figures = attention_figures(model, tokenizer, src_ids, tgt_ids)
        paths = {tag: check_output(out / f"{tag.replace('/', '_')}.png", [cfg.checkpoint], key=None) for tag in figures}
        for tag, figure in figures.items():
            with atomic_open(paths[tag]) as f:
                figure.savefig(f, format="png", dpi=120)
            plt.close(figure)
            print(f"wrote {paths[tag]}")


if __name__ == "__main__":
    main(sys.argv[1:])
