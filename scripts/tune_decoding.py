"""Choose the beam size and length penalty on a held-out split: decode it with every pair of a
grid, score each with sacreBLEU, and print the overrides of the best.

    python scripts/tune_decoding.py checkpoint=outputs/en-de/RUN/checkpoint_avg5.pt
    python scripts/tune_decoding.py checkpoint=PATH beam_sizes=[4,5,8] length_penalties=[0.6,1.0]

Arguments (key=value, as for train.py):
    checkpoint=PATH   ensemble=[PATH,...]   device=auto|cpu|cuda
    split=val         the split to tune on, from the training run's corpus (data_dir=, src_lang=,
                      tgt_lang= override it); or src=PATH ref=PATH. Tune on a validation split:
                      settings chosen on a test split make that split's score optimistic.
    beam_sizes=[1,4,5,8]               length_penalties=[0.0,0.6,1.0,1.4]
                      length_penalty is GNMT's alpha: scores are log-probabilities divided by
                      ((5 + length) / 6) ** alpha, so 0 ranks by log-probability and larger values
                      favour longer translations.
    metric=bleu       what chooses: bleu (cased), bleu_lc (lowercased) or chrf
    output=PATH       the JSON of every score; default: <checkpoint>.<split>.decoding.json
    decode.*          the other decoding settings (max_len_a, max_len_b, min_len, max_tokens); runtime.precision

Ties go to the smaller beam, then to the penalty listed first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from transformer.cli import ScoringInputs, parse_args, setup_logging, source_and_reference
from transformer.data import read_parallel
from transformer.decoding import DecodeConfig
from transformer.errors import ConfigError, exit_on_user_error
from transformer.evaluation import score
from transformer.files import atomic_write_text, check_output
from transformer.translator import Translator

log = logging.getLogger("tune_decoding")
METRICS = ("bleu", "bleu_lc", "chrf")


@dataclass
class TuneConfig(ScoringInputs):
    split: str = "val"
    beam_sizes: list[int] = field(default_factory=lambda: [1, 4, 5, 8])
    length_penalties: list[float] = field(default_factory=lambda: [0.0, 0.6, 1.0, 1.4])
    metric: str = "bleu"
    output: Optional[str] = None
    device: str = "auto"
    decode: DecodeConfig = field(default_factory=DecodeConfig)


def check(cfg: TuneConfig) -> None:
    if cfg.metric not in METRICS:
        raise ConfigError(f"metric={cfg.metric!r} is not one of {METRICS}")
    if not cfg.beam_sizes or not cfg.length_penalties:
        raise ConfigError("beam_sizes and length_penalties must each hold at least one value")
    if min(cfg.beam_sizes) < 1:
        raise ConfigError(f"beam_sizes={list(cfg.beam_sizes)}: every beam size must be at least 1")
    if not all(0 <= alpha < math.inf for alpha in cfg.length_penalties):
        raise ConfigError(f"length_penalties={list(cfg.length_penalties)}: every penalty must be >= 0 and finite")
    if cfg.src is None and cfg.split.startswith("test"):
        log.warning("tuning on %s: its scores will be optimistic; tune on a validation split", cfg.split)


def grid(cfg: TuneConfig) -> list[DecodeConfig]:
    return [
        dataclasses.replace(cfg.decode, strategy="beam", beam_size=k, n_best=1, length_penalty=float(alpha))
        for k in sorted(set(cfg.beam_sizes))
        for alpha in dict.fromkeys(cfg.length_penalties)
    ]


def table(rows: list[dict], metric: str, best: dict) -> str:
    """Markdown: one row per beam size, one column per length penalty; the best in bold."""
    penalties = list(dict.fromkeys(r["length_penalty"] for r in rows))
    lines = ["| beam \\ length penalty | " + " | ".join(f"{a:g}" for a in penalties) + " |"]
    lines.append("|---:|" + "---:|" * len(penalties))
    for k in dict.fromkeys(r["beam_size"] for r in rows):
        cells = []
        for a in penalties:
            row = next(r for r in rows if r["beam_size"] == k and r["length_penalty"] == a)
            cell = f"{row[metric]:.2f}"
            cells.append(f"**{cell}**" if row is best else cell)
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scan(cfg: TuneConfig, translator: Translator, src_path: Path, ref_path: Path) -> tuple[list[dict], dict]:
    """Decode the source with every grid point: (one row of scores per point, the signatures)."""
    sources, references = read_parallel(src_path, ref_path)
    rows, signatures = [], {}
    for decode_cfg in grid(cfg):
        hyps = translator.translate(sources, decode_cfg, source_name=str(src_path))
        cased, lowercased = score(hyps, references), score(hyps, references, lowercase=True)
        signatures = {"bleu": cased.bleu_signature, "bleu_lc": lowercased.bleu_signature, "chrf": cased.chrf_signature}
        rows.append(
            {
                "beam_size": decode_cfg.beam_size,
                "length_penalty": decode_cfg.length_penalty,
                "bleu": cased.bleu,
                "bleu_lc": lowercased.bleu,
                "chrf": cased.chrf,
                "mean_words": sum(len(h.split()) for h in hyps) / max(len(hyps), 1),
            }
        )
        log.info("beam %d, length penalty %g: BLEU %.2f, lowercased %.2f, chrF %.2f", decode_cfg.beam_size, decode_cfg.length_penalty, cased.bleu, lowercased.bleu, cased.chrf)  # fmt: skip
    return rows, signatures


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, TuneConfig, __doc__)
        check(cfg)
        translator = Translator.load(cfg.checkpoint, cfg.ensemble, cfg.device, cfg.decode, cfg.runtime)
        src_path, ref_path = source_and_reference(cfg, translator.payload.get("train_config", {}))
        default_output = Path(cfg.checkpoint).with_suffix(f".{src_path.name.split('.')[0]}.decoding.json")
        output = check_output(cfg.output or default_output, [cfg.checkpoint, *cfg.ensemble, src_path, ref_path])
        rows, signatures = scan(cfg, translator, src_path, ref_path)
        best = max(rows, key=lambda r: r[cfg.metric])  # max keeps the first of equals: the grid's order
        result = {
            "checkpoint": cfg.checkpoint,
            "ensemble": list(cfg.ensemble),
            "source": str(src_path),
            "reference": str(ref_path),
            "metric": cfg.metric,
            "signatures": signatures,
            "results": rows,
            "best": best,
        }
        atomic_write_text(output, json.dumps(result, indent=2) + "\n")
        print(f"{cfg.metric} on {src_path.name} -> {ref_path.name} ({signatures[cfg.metric]}):\n")
        print(table(rows, cfg.metric, best))
        alpha = best["length_penalty"]
        print(f"\nbest: decode.beam_size={best['beam_size']} decode.length_penalty={alpha:g} ({cfg.metric} {best[cfg.metric]:.2f})")  # fmt: skip
        print(f"wrote {output}")


if __name__ == "__main__":
    main(sys.argv[1:])
