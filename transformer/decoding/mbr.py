"""Minimum Bayes risk (MBR) reranking of beam search's n-best lists: `decode.mbr=chrf|bleu`.

Beam search returns the hypothesis the model scores highest. MBR returns instead the hypothesis
that agrees most with the others: each candidate h of a sentence's list gets its expected utility

    U(h) = sum_j  w_j * utility(h, y_j)

over the same list as pseudo-references y_j, where utility is sentence-level chrF or BLEU
(sacreBLEU, BLEU with effective order) and the weights w_j are the model's probabilities of the
y_j renormalized over the list (`decode.mbr_weights=model`) or equal (`uniform`). The list is
sorted by U, so the first hypothesis is the MBR choice. Candidates that detokenize to the same
text are one candidate (their weights add up), since the metrics see only the text.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .config import MBR_UTILITIES as UTILITIES
from .config import MBR_WEIGHTS as WEIGHTS


def utility(name: str) -> Callable[[str, str], float]:
    """Sentence-level `name`(hypothesis, reference) on sacreBLEU's 0-100 scale."""
    from sacrebleu.metrics import BLEU, CHRF  # here, not at the top: a plain translation never needs it (start-up)

    if name == "chrf":
        metric = CHRF()
    elif name == "bleu":
        metric = BLEU(effective_order=True)  # short sentences would otherwise score 0
    else:
        raise ValueError(f"no MBR utility {name!r}; one of {UTILITIES[1:]}")
    return lambda hyp, ref: metric.sentence_score(hyp, [ref]).score


def expected_utilities(texts: list[str], log_probs: list[float], weights: str, metric) -> list[float]:
    """Each text's expected utility against the list (see the module docstring)."""
    unique = list(dict.fromkeys(texts))
    if weights == "uniform":
        mass = {t: texts.count(t) / len(texts) for t in unique}
    else:  # softmax of the log-probabilities, summed over duplicate texts
        top = max(log_probs)
        raw = [math.exp(lp - top) for lp in log_probs]
        total = sum(raw)
        mass = dict.fromkeys(unique, 0.0)
        for text, r in zip(texts, raw):
            mass[text] += r / total
    gains = {h: sum(mass[y] * (100.0 if h == y else metric(h, y)) for y in unique) for h in unique}
    return [gains[t] for t in texts]


def rerank(n_best: list[list], texts: list[list[str]], utility_name: str, weights: str) -> list[list]:
    """Each sentence's hypotheses sorted by expected utility, highest first; a stable sort, so
    ties keep the beam's order. n_best: per sentence, Hypothesis objects (with .log_prob);
    texts: the same hypotheses detokenized."""
    if weights not in WEIGHTS:
        raise ValueError(f"decode.mbr_weights={weights!r} is not one of {WEIGHTS}")
    metric = utility(utility_name)
    out = []
    for hyps, strings in zip(n_best, texts):
        if len(hyps) < 2:
            out.append(hyps)
            continue
        gains = expected_utilities(strings, [h.log_prob for h in hyps], weights, metric)
        order = sorted(range(len(hyps)), key=lambda i: -gains[i])
        out.append([hyps[i] for i in order])
    return out
