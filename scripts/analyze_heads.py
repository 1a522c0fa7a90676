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
from transformer.decoding import DecodeConfig
from transformer.errors import exit_on_user_error
from transformer.files import atomic_open, check_output
from transformer.runtime import RuntimeConfig


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
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        if self.sentences < 1:
            raise ValueError(f"sentences={self.sentences} must be >= 1")
        if not all(k >= 1 for k in self.prune):
            raise ValueError(f"prune={list(self.prune)}: every number of heads to prune must be >= 1")


def data_config(cfg: HeadsConfig, payload: dict):
    """The training run's data settings, with data_dir= applied."""
    from transformer.checkpoint import CheckpointError, train_config_of
    from transformer.data import DataConfig

    try:
        data = DataConfig(**train_config_of(payload, cfg.checkpoint)["data"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg.checkpoint} has bad train_config data settings: {e}") from None
    data.dir = cfg.data_dir or data.dir
    return data


def output_paths(cfg: HeadsConfig, data) -> tuple[Path, Path]:
    """The two PNGs (BLEU lost, confidence); neither may replace an input or a checkpoint."""
    from transformer.data import corpus_file

    inputs = [cfg.checkpoint]
    if not data.hub_name:
        inputs += [corpus_file(Path(data.dir), cfg.split, lang) for lang in (data.src_lang, data.tgt_lang)]
    output = check_output(cfg.output or Path(cfg.checkpoint).with_suffix(".heads.png"), inputs)
    return output, check_output(output.with_name(output.stem + "_confidence.png"), inputs)


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, HeadsConfig, __doc__)
        from transformer.analysis.heads import head_confidence, head_importance, masked_bleu, prune_least_important
        from transformer.analysis.plotting import head_heatmap, plt
        from transformer.data import load_split
        from transformer.data.batching import tokenize
        from transformer.translator import Translator

        translator = Translator.load(cfg.checkpoint, [], cfg.device, cfg.decode, cfg.runtime)
        model, tokenizer = translator.model, translator.tokenizer
        data = data_config(cfg, translator.payload)
        output, confidence_output = output_paths(cfg, data)
        ds = load_split(data, cfg.split)
        corpus = tokenize(ds.select(range(min(cfg.sentences, len(ds)))), tokenizer, data.tgt_lang)
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
        for path, figure in ((confidence_output, head_heatmap(confidence, "head confidence", "confidence")), (output, head_heatmap(drops, "BLEU lost when masked", "BLEU"))):  # fmt: skip
            with atomic_open(path) as f:
                figure.savefig(f, format="png", dpi=120)
            plt.close(figure)
        print(f"wrote {output} and {confidence_output}")


if __name__ == "__main__":
    main(sys.argv[1:])
