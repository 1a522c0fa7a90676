"""One recipe over several seeds: each seed's scores, their mean and standard deviation, and paired
tests of each seed against another system, as docs/RESULTS.md reports each recipe.

    python scripts/lab/seed_table.py runs=[RUN1,RUN2,RUN3]
    python scripts/lab/seed_table.py runs=[RUN1,RUN2,RUN3] baseline=OTHER_RUN

Each RUN is a train.py run directory. Its hypotheses RUN/<split>.<decoding>.<target language> are
scored against the references of the run's corpus (RUN/.hydra/config.yaml) with sacreBLEU: BLEU
cased and lowercased, and chrF. train.py writes the test splits' hypotheses; those of the
validation split come from

    python evaluate.py checkpoint=RUN/checkpoint_best.pt split=val output=RUN/val.beam5.en

A trainer.members run (the en-de recipe) writes its ensemble's, validation's included, as
<split>.ensemble.beam5.<lang>: pass decoding=ensemble.beam5.

With baseline=, every seed is compared with that run's hypotheses of each test split by
sacreBLEU's paired bootstrap and approximate randomization (transformer/significance.py).
baseline_decoding= names the baseline's files where they differ, e.g. an ensemble's seeds against
one of its members: baseline=RUN/member0 baseline_decoding=avg5.beam5.

Arguments (key=value, as for train.py):
    runs=[DIR,...]    the seeds' run directories (all on the same corpus and language pair)
    splits=[val,test_2016_flickr,test_2017_flickr]
    decoding=beam5    which hypotheses, as the files are named: beam5, greedy, ensemble.beam5
    baseline=DIR      another run (or any directory holding <split>.<decoding>.<lang> files)
    baseline_decoding=NAME   the baseline's hypotheses, <split>.<NAME>.<lang> (default: decoding)
    seed=12345        the paired tests' random draws
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from transformer.cli import parse_args
from transformer.data import DataConfig, corpus_file, read_lines
from transformer.errors import ConfigError, exit_on_user_error
from transformer.evaluation import Scores, score
from transformer.significance import compare

COLUMNS = ("BLEU", "BLEU lc", "chrF")


@dataclass
class SeedTableConfig:
    runs: list[str] = field(default_factory=list)
    splits: list[str] = field(default_factory=lambda: ["val", "test_2016_flickr", "test_2017_flickr"])
    decoding: str = "beam5"
    baseline: Optional[str] = None
    baseline_decoding: Optional[str] = None  # None: the same as decoding
    seed: int = 12345

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError("runs=[DIR,...] names no run")
        if self.seed < 1:  # sacreBLEU reads a seed of 0 as "no seed"
            raise ValueError(f"seed={self.seed} must be >= 1")


def corpus(run: Path) -> tuple[Path, str]:
    """The data directory and target language a run was trained on."""
    path = run / ".hydra" / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: {run} is not a train.py run directory")
    data = OmegaConf.load(path).get("data", {})
    return Path(data.get("dir", DataConfig.dir)), str(data.get("tgt_lang"))


def hypotheses(directory: Path, split: str, decoding: str, lang: str, refs: list[str]) -> list[str]:
    """A run's (or the baseline's) translations of split, one per reference."""
    path = directory / f"{split}.{decoding}.{lang}"
    if not path.is_file():
        hint = (
            f"; write it with: python evaluate.py checkpoint={directory}/checkpoint_best.pt split={split} output={path}"
        )
        raise ConfigError(f"{path} does not exist{hint if decoding == 'beam5' else ''}")
    lines = read_lines(path)
    if len(lines) != len(refs):
        raise ConfigError(f"{path} has {len(lines)} lines, its references {len(refs)}")
    return lines


def scores(hyps: list[str], refs: list[str]) -> tuple[Scores, Scores]:
    """(cased, lowercased) sacreBLEU; chrF is the cased one's."""
    return score(hyps, refs), score(hyps, refs, lowercase=True)


def values(pair: tuple[Scores, Scores]) -> tuple[float, float, float]:
    cased, lowercased = pair
    return cased.bleu, lowercased.bleu, cased.chrf


def mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {sd:.2f}"


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, SeedTableConfig, __doc__)
        runs = [Path(r) for r in cfg.runs]
        corpora = {corpus(run) for run in runs}
        if len(corpora) > 1:
            raise ConfigError(f"the runs were trained on different corpora or targets: {sorted(map(str, corpora))}")
        data_dir, lang = corpora.pop()
        refs = {split: read_lines(corpus_file(data_dir, split, lang)) for split in cfg.splits}
        texts = {
            (run, split): hypotheses(run, split, cfg.decoding, lang, refs[split])
            for run in runs
            for split in cfg.splits
        }
        scored = {key: scores(hyps, refs[key[1]]) for key, hyps in texts.items()}
        table = {key: values(pair) for key, pair in scored.items()}
        header = " | ".join(f"{split} {c}" for split in cfg.splits for c in COLUMNS)
        print(f"{cfg.decoding}, sacreBLEU: BLEU cased, BLEU lowercased (-lc), chrF\n")
        print(f"| run | {header} |")
        print("|---|" + "---:|" * (len(cfg.splits) * len(COLUMNS)))
        for run in runs:
            cells = " | ".join(f"{v:.2f}" for split in cfg.splits for v in table[run, split])
            print(f"| {run} | {cells} |")
        means = " | ".join(
            mean_sd([table[run, split][i] for run in runs]) for split in cfg.splits for i in range(len(COLUMNS))
        )
        print(f"| mean ± sd over {len(runs)} | {means} |")
        cased, lowercased = next(iter(scored.values()))
        print(f"\n{cased.bleu_signature}\n{lowercased.bleu_signature}\n{cased.chrf_signature}")
        if cfg.baseline is None:
            return
        baseline = Path(cfg.baseline)
        baseline_decoding = cfg.baseline_decoding or cfg.decoding
        print(f"\npaired tests against baseline={baseline}, {baseline_decoding} (seed {cfg.seed}):")
        for split in (s for s in cfg.splits if s != "val"):
            base = hypotheses(baseline, split, baseline_decoding, lang, refs[split])
            for run in runs:
                for result in compare(base, texts[run, split], refs[split], seed=cfg.seed):
                    print(f"  {split} {run}: {result.summary()}")


if __name__ == "__main__":
    main(sys.argv[1:])
