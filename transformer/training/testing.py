"""The end of a run: the best checkpoint's translations of each test split (each direction of a
many-to-many run's), written beside the checkpoints and scored with BLEU and chrF."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from ..data import has_corpus_file, load_split, write_lines
from ..data.batching import TokenizedCorpus, tokenize
from ..data.tokenizer import Tokenizer
from ..evaluation import score
from ..translator import Translator

log = logging.getLogger(__name__)


def report(message: str) -> None:
    """Results: through logging, which train.py sends to stdout and to the run's log file."""
    log.info(message)


def hypotheses_path(run_dir: Path, split: str, label: str, lang: str) -> Path:
    """Where a run keeps its translations of a split: {split}.{label}.{lang}, as
    scripts/seed_table.py reads them (label: e.g. beam5, avg5.beam5, ensemble.beam5)."""
    return run_dir / f"{split}.{label}.{lang}"


def test_sets(cfg, split: str, tokenizer: Tokenizer) -> list[tuple[str, TokenizedCorpus]]:
    """(direction, its pairs) for each direction of `split` to test: the run's one direction, or
    for a many-to-many run each direction whose files the split has (test_2017_flickr has no cs)."""
    if not cfg.data.multilingual:
        return [(f"{cfg.data.src_lang}-{cfg.data.tgt_lang}", tokenize(load_split(cfg.data, split), tokenizer, cfg.data.tgt_lang))]  # fmt: skip
    pairs = cfg.data.pairs
    if not cfg.data.hub_name:
        have = lambda lang: has_corpus_file(Path(cfg.data.dir), split, lang)  # noqa: E731
        skipped = [f"{s}-{t}" for s, t in pairs if not (have(s) and have(t))]
        if skipped:
            log.info("%s has no %s: not tested", split, ", ".join(skipped))
        pairs = [(s, t) for s, t in pairs if have(s) and have(t)]
    if not pairs:
        return []
    corpus = tokenize(load_split(cfg.data, split, pairs), tokenizer)
    return [(name, corpus.subset(rows)) for name, rows in corpus.directions().items()]


def evaluate_tests(cfg, run_dir: Path, translator: Translator, tag: str = "") -> dict[str, dict]:
    """Decode each test split greedily and with the configured strategy; write the hypotheses
    next to the checkpoints as {split}.{tag}{strategy}.{tgt_lang} ({direction} instead of
    {tgt_lang} for a many-to-many run, which also reports the mean over directions); report BLEU
    and chrF."""
    strategies = [cfg.decode.greedy()]
    if cfg.decode.strategy != "greedy":
        strategies.append(cfg.decode)
    results = {}
    for split in cfg.data.test_splits:
        sets = test_sets(cfg, split, translator.tokenizer)
        for decode_cfg in strategies:
            label = tag + decode_cfg.label
            bleus = []
            for name, corpus in sets:
                hyps = translator.translate_corpus(corpus, decode_cfg)
                suffix = name if cfg.data.multilingual else cfg.data.tgt_lang
                write_lines(hypotheses_path(run_dir, split, label, suffix), hyps)
                scores, lowercased = score(hyps, corpus.tgt_text), score(hyps, corpus.tgt_text, lowercase=True)
                report(scores.summary(f"{split} {name} {label}") + f" | lowercased BLEU {lowercased.bleu:.2f}")
                key = f"{split}/{name}/{decode_cfg.label}" if cfg.data.multilingual else f"{split}/{decode_cfg.label}"
                results[key] = dataclasses.asdict(scores) | {
                    "bleu_lc": lowercased.bleu,
                    "bleu_lc_signature": lowercased.bleu_signature,
                }
                bleus.append(scores.bleu)
            if cfg.data.multilingual and bleus:
                report(f"{split} mean of {len(bleus)} directions {label}: BLEU {sum(bleus) / len(bleus):.2f}")
                results[f"{split}/mean/{decode_cfg.label}"] = {
                    "bleu": sum(bleus) / len(bleus),
                    "directions": len(bleus),
                }
        if split == cfg.data.test_splits[0] and sets:
            corpus = sets[-1][1]  # the set hyps belong to
            for src, ref, hyp in list(zip(corpus.src_text, corpus.tgt_text, hyps))[:3]:
                report(f"  source:      {src}\n  reference:   {ref}\n  translation: {hyp}")
    return results
