"""Markdown tables of a run's test scores, as docs/RESULTS.md shows them.

    python scripts/lab/results_table.py run=outputs/de-en/RUN
    python scripts/lab/results_table.py run=outputs/de-en/RUN budgets=true   # also the budgets of evaluate_budgets.py

Reads RUN/results.json (written by train.py) and, with budgets=true, RUN/budgets.json. Prints
one row per model (best checkpoint, average, or the ensemble of a trainer.members run), test split
and decoding, with sacreBLEU cased and lowercased and chrF, then the signatures and how each
model was trained.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from transformer.cli import parse_args
from transformer.errors import ConfigError, exit_on_user_error


@dataclass
class TableConfig:
    run: str = "???"
    budgets: bool = False


def rows(label: str, tests: dict) -> list[str]:
    out = []
    for key, s in tests.items():
        split, decoding = key.split("/")
        out.append(f"| {label} | {split} | {decoding} | {s['bleu']:.2f} | {s['bleu_lc']:.2f} | {s['chrf']:.2f} |")
    return out


def model_label(results: dict) -> str:
    if "members" in results:
        return f"ensemble of {len(results['members'])} members ({results['chosen']}, chosen on val)"
    return f"best checkpoint (step {results['best_step']})"


def training_lines(results: dict) -> list[str]:
    """How each model trained: one line, or one per member."""
    runs = results.get("members", [results])
    return [
        ("" if len(runs) == 1 else f"member {i}: ")
        + f"{r['steps']} steps ({r['epochs']:.1f} epochs) in {r['train_minutes']:.1f} min, "
        f"{r['tokens_per_s']:.0f} tokens/s, {r['autocast']}, {r['parameters']:,} parameters"
        for i, r in enumerate(runs)
    ]


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, TableConfig, __doc__)
        run = Path(cfg.run)
        has_results = (run / "results.json").is_file()
        if not has_results and not (cfg.budgets and (run / "budgets.json").is_file()):
            raise ConfigError(f"{run / 'results.json'} does not exist (written at the end of train.py)")
        results = json.loads((run / "results.json").read_text()) if has_results else {"test": {}}
        lines = ["| model | split | decoding | BLEU | BLEU (lc) | chrF |", "|---|---|---|---:|---:|---:|"]
        if has_results:
            lines += rows(model_label(results), results["test"])
        for key in results:
            if key.startswith("test_avg"):
                lines += rows(f"average of {len(results['average']['checkpoints'])} checkpoints", results[key])
        first = next(iter(results["test"].values()), None)
        if cfg.budgets:
            budgets = json.loads((run / "budgets.json").read_text())
            for name, b in budgets.items():
                minutes, model = name.split("/")
                lines += rows(f"{minutes} min, {model} (to step {b['last_step']})", b["test"])
                first = first or next(iter(b["test"].values()))
        print("\n".join(lines))
        print(f"\nBLEU: `{first['bleu_signature']}`  \nBLEU (lc): `{first['bleu_lc_signature']}`  \nchrF: `{first['chrf_signature']}`")  # fmt: skip
        if has_results:
            print("\n" + "  \n".join(training_lines(results)))


if __name__ == "__main__":
    main(sys.argv[1:])
