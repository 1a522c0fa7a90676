"""Time to quality: score a run as if it had been stopped after each of several training budgets.

    python scripts/lab/evaluate_budgets.py run=outputs/de-en/RUN minutes=[30,60,90] average=5

For each budget M it takes the run's validations whose training clock (`train_minutes` in
metrics.jsonl, counted as trainer.max_minutes counts it) is at most M, and scores on `splits`
(the validation split, to choose between the two, and the test splits), greedy and with the
run's decoding settings (beam 5 by default):
  - best: the checkpoint with the highest validation BLEU among them;
  - avgN: the average of the last N of their numbered checkpoints.
Both are chosen from the validation split and the budget alone. The learning-rate schedule does
not depend on the budget, so this equals a run with trainer.max_minutes=M, except that such a
run would also validate once more at the step where the budget ends (unless that falls within
a quarter of trainer.eval_every after a validation). The run must keep its
numbered checkpoints (trainer.keep_last large enough).

Writes RUN/budgets.json and prints one line per budget and model.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from transformer import checkpoint
from transformer.cli import parse_args, setup_logging
from transformer.config import to_config
from transformer.devices import pick_device
from transformer.errors import ConfigError, exit_on_user_error
from transformer.files import atomic_write_text, check_output
from transformer.training.testing import evaluate_tests
from transformer.translator import Translator


@dataclass
class BudgetConfig:
    run: str = "???"
    minutes: list[float] = field(default_factory=lambda: [30.0, 60.0, 90.0])
    average: int = 5
    splits: list[str] = field(default_factory=lambda: ["val", "test_2016_flickr", "test_2017_flickr"])
    device: str = "auto"

    def __post_init__(self) -> None:
        if not self.minutes or not all(m > 0 for m in self.minutes):
            raise ValueError(f"minutes={list(self.minutes)} must hold one or more budgets, each > 0")
        if self.average < 1:  # 1: the best checkpoint only
            raise ValueError(f"average={self.average} must be >= 1")


def validations(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; run= must be a training run directory")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found = [r for r in records if "valid_bleu" in r and "train_minutes" in r]
    if not found:
        raise ConfigError(f"{path} has no validations with train_minutes (written by newer versions of train.py)")
    return found


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, BudgetConfig, __doc__)
        run_dir, device = Path(cfg.run), pick_device(cfg.device)
        records = validations(run_dir)
        out = check_output(run_dir / "budgets.json", [run_dir / "metrics.jsonl"], key=None)
        results = {}
        for budget in cfg.minutes:
            inside = [r for r in records if r["train_minutes"] <= budget]
            if not inside:
                raise ConfigError(f"no validation within {budget} minutes in {run_dir}")
            steps = [r["step"] for r in inside]
            paths = [run_dir / f"checkpoint_{s}.pt" for s in steps if (run_dir / f"checkpoint_{s}.pt").is_file()]
            best = max(inside, key=lambda r: r["valid_bleu"])
            candidates = {"best": [run_dir / f"checkpoint_{best['step']}.pt"]}
            if cfg.average > 1:
                candidates[f"avg{cfg.average}"] = paths[-cfg.average :]
            for name, chosen in candidates.items():
                missing = [p for p in chosen if not p.is_file()]
                if missing or len(chosen) < (cfg.average if name != "best" else 1):
                    raise ConfigError(f"{run_dir} no longer holds {missing[0].name if missing else 'enough numbered checkpoints'} (raise trainer.keep_last)")  # fmt: skip
                payload = checkpoint.average(chosen) if len(chosen) > 1 else checkpoint.load(chosen[0])
                train_cfg = to_config(OmegaConf.create(checkpoint.train_config_of(payload, chosen[-1])))
                train_cfg.data.test_splits = list(cfg.splits)
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "model.pt"
                    checkpoint.write(path, payload)
                    translator = Translator.load(path, [], str(device), train_cfg.decode, train_cfg.runtime)
                scores = evaluate_tests(train_cfg, run_dir, translator, tag=f"{budget:g}min.{name}.")
                results[f"{budget:g}/{name}"] = {
                    "budget_minutes": budget,
                    "last_step": inside[-1]["step"],
                    "train_minutes": inside[-1]["train_minutes"],
                    "checkpoints": [p.name for p in chosen],
                    "valid_bleu_of_best": best["valid_bleu"],
                    "test": scores,
                }
                for key, s in scores.items():
                    print(f"{budget:g} min {name:>6} ({len(chosen)} ckpt, last step {inside[-1]['step']}): {key} BLEU {s['bleu']:.2f} lc {s['bleu_lc']:.2f} chrF {s['chrf']:.2f}")  # fmt: skip
        atomic_write_text(out, json.dumps(results, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
