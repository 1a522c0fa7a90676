"""Corpus-level sacreBLEU and chrF, always reported with their signatures."""

from __future__ import annotations

from dataclasses import dataclass

from sacrebleu.metrics import BLEU, CHRF


@dataclass
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str

    def summary(self, name: str) -> str:
        return f"{name}: BLEU {self.bleu:.2f} ({self.bleu_signature}) | chrF {self.chrf:.2f} ({self.chrf_signature})"


def score(hypotheses: list[str], references: list[str], lowercase: bool = False) -> Scores:
    """sacreBLEU with its standard settings (13a tokenization, cased unless lowercase)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = BLEU(lowercase=lowercase), CHRF()
    bleu_result = bleu.corpus_score(hypotheses, [references])
    chrf_result = chrf.corpus_score(hypotheses, [references])
    return Scores(bleu_result.score, chrf_result.score, str(bleu.get_signature()), str(chrf.get_signature()))
