"""Is system B better than system A on the same references, or is the difference chance? sacreBLEU's
paired tests (sacrebleu.significance.PairedTest) for BLEU and chrF: paired bootstrap resampling
(Koehn, 2004) and paired approximate randomization (Riezler and Maxwell, 2005), each with its
p-value, and the 95% confidence interval of the difference B - A over the bootstrap's resamples.

Every random draw comes from `seed`, so a comparison repeats exactly. Two adjustments to what
sacreBLEU prints, both documented in docs/DECODING.md:
- sacreBLEU counts the resamples whose statistic is strictly above the observed difference, so an
  observed difference of exactly 0 (two identical systems) gets the smallest p-value it can give,
  1/(samples + 1), as if it were significant. Every resample is at least as far from equality as
  a difference of 0, so its p-value is 1.
- sacreBLEU reports each system's interval, not the difference's; the difference's is computed
  here from the same resamples as its paired bootstrap (the same seed draws the same indices).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest


@dataclass
class Comparison:
    metric: str  # BLEU or chrF2
    baseline: float
    system: float
    difference: float  # system - baseline
    low: float  # 95% confidence interval of the difference (paired bootstrap percentiles)
    high: float
    p_bootstrap: float  # two-sided p-values: the difference arose by chance
    p_randomization: float

    def summary(self) -> str:
        return (
            f"{self.metric}: baseline {self.baseline:.2f}, system {self.system:.2f}, "
            f"difference {self.difference:+.2f} (95% CI {self.low:+.2f} to {self.high:+.2f}), "
            f"p = {self.p_bootstrap:.4f} (paired bootstrap), p = {self.p_randomization:.4f} (approximate randomization)"
        )


@contextmanager
def sacrebleu_seed(seed: int) -> Iterator[None]:
    """PairedTest reads its seed from the SACREBLEU_SEED environment variable (when it is built
    and when it runs); it is set for those calls only and restored after. Its progress messages
    (INFO on the "sacrebleu" logger) are held back meanwhile."""
    before, logger = os.environ.get("SACREBLEU_SEED"), logging.getLogger("sacrebleu")
    level = logger.level
    os.environ["SACREBLEU_SEED"] = str(seed)
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
        if before is None:
            del os.environ["SACREBLEU_SEED"]
        else:
            os.environ["SACREBLEU_SEED"] = before


def metrics(lowercase: bool) -> dict:
    """The metrics compared, with the settings evaluate.py scores with."""
    return {"BLEU": BLEU(lowercase=lowercase), "chrF": CHRF()}


def paired_test(kind: str, baseline, system, references, lowercase: bool, samples: int, seed: int) -> dict:
    """sacreBLEU's paired test `kind` ("bs" or "ar"): {metric name: (baseline Result, system Result)}."""
    with sacrebleu_seed(seed):
        systems = [("baseline", baseline), ("system", system)]
        test = PairedTest(systems, metrics(lowercase), [references], test_type=kind, n_samples=samples)
        _, results = test()
    return {name: tuple(pair) for name, pair in results.items() if name != "System"}


def bootstrap_differences(metric, baseline, system, references, samples: int, seed: int) -> np.ndarray:
    """(samples,) system - baseline scores on the paired bootstrap's resamples: the indices are
    drawn as sacreBLEU's paired bootstrap draws them, and scored from each sentence's statistics
    by the metric's own functions, as PairedTest does."""
    indices = np.random.default_rng(seed).choice(len(references), size=(samples, len(references)), replace=True)
    scores = []
    for hyps in (baseline, system):
        stats = np.array(metric._extract_corpus_statistics(hyps, [references]), dtype="float32")
        scores.append(np.array([metric._compute_score_from_stats(s.sum(0)).score for s in stats[indices]]))
    return scores[1] - scores[0]


def compare(
    baseline: list[str],
    system: list[str],
    references: list[str],
    lowercase: bool = False,
    seed: int = 12345,
    bootstrap_samples: int = 1000,
    randomization_trials: int = 10000,
) -> list[Comparison]:
    """Both paired tests for BLEU and chrF between two systems' translations of the same sentences."""
    if not len(baseline) == len(system) == len(references):
        raise ValueError(f"{len(baseline)} and {len(system)} hypotheses for {len(references)} references")
    if seed < 1:  # PairedTest reads a seed of 0 as "no seed"
        raise ValueError(f"seed={seed} must be >= 1")
    bootstrap = paired_test("bs", baseline, system, references, lowercase, bootstrap_samples, seed)
    randomization = paired_test("ar", baseline, system, references, lowercase, randomization_trials, seed)
    out = []
    for (name, (base, sys)), metric in zip(bootstrap.items(), metrics(lowercase).values()):
        differences = bootstrap_differences(metric, baseline, system, references, bootstrap_samples, seed)
        low, high = np.percentile(differences, [2.5, 97.5])
        same = sys.score == base.score  # see the module docstring: no resample can be closer than 0
        p_ar = randomization[name][1].p_value
        out.append(
            Comparison(name, base.score, sys.score, sys.score - base.score, float(low), float(high),
                       1.0 if same else sys.p_value, 1.0 if same else p_ar)
        )  # fmt: skip
    return out
