"""Training curves of one or more runs from their metrics.jsonl: validation BLEU and loss per step.

python scripts/plot_curves.py runs=[outputs/de-en/RUN] output=curves.png
python scripts/plot_curves.py runs=[RUN_A,RUN_B] labels=[fp32,bf16] output=compare.png
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformer.cli import parse_args
from transformer.errors import ConfigError, exit_on_user_error
from transformer.files import atomic_open, check_output


@dataclass
class CurvesConfig:
    runs: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # default: the run directories' names
    output: str = "curves.png"


def validation_records(run: Path) -> list[dict]:
    """The validation records of a run, the last one per step (a resumed run repeats steps)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run} has no metrics.jsonl (is it a run directory?)")
    by_step = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "valid_loss" in record:
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, CurvesConfig, __doc__)
        if not cfg.runs:
            raise ConfigError("give runs=[RUN_DIR,...]")
        labels = cfg.labels or [Path(r).name for r in cfg.runs]
        if len(labels) != len(cfg.runs):
            raise ConfigError(f"{len(labels)} labels for {len(cfg.runs)} runs")
        output = check_output(cfg.output, [Path(run) / "metrics.jsonl" for run in cfg.runs])
        from transformer.plotting import plt

        fig, (bleu_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
        image_format = output.suffix[1:].lower()
        if image_format not in fig.canvas.get_supported_filetypes():
            raise ConfigError(f"output={output}: matplotlib cannot write .{image_format} files; use .png, .pdf or .svg")
        for run, label in zip(cfg.runs, labels):
            records = validation_records(Path(run))
            steps = [r["step"] for r in records]
            if all("valid_bleu" in r for r in records):
                bleu_ax.plot(steps, [r["valid_bleu"] for r in records], marker="o", label=label)
            loss_ax.plot(steps, [r["valid_loss"] for r in records], marker="o", label=label)
        bleu_ax.set(xlabel="step", ylabel="validation BLEU (greedy)", title="BLEU")
        loss_ax.set(xlabel="step", ylabel="validation loss (nats/token)", title="loss")
        for ax in (bleu_ax, loss_ax):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        with atomic_open(output) as f:
            fig.savefig(f, format=image_format, dpi=120)
        print(f"wrote {output}")


if __name__ == "__main__":
    main(sys.argv[1:])
