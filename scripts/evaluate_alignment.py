"""Score the word alignments that `decode.alignment=true` prints against hand-made gold alignments:
precision, recall and alignment error rate (AER) of every decoder layer's cross-attention,
aligning each target piece by the step that reads it and by the step that predicts it. The gold is aligned on its reference translations, so this measures the
alignments alone, not the translations.

    python scripts/evaluate_alignment.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt

Arguments (key=value, as for train.py):
    checkpoint=PATH   ensemble=[PATH,...]   device=auto|cpu|cuda
    gold=tests/data/alignment/test_2016_flickr_de_en
                      GOLD.de, GOLD.en (whitespace-separated words) and GOLD.align (sure links i-j,
                      source word i, target word j, from 0), one sentence pair per line
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformer.cli import parse_args, setup_logging
from transformer.data import read_lines, read_parallel
from transformer.decoding.alignment import align, alignment_error, read_pharaoh, transformers
from transformer.errors import DataError, exit_on_user_error
from transformer.runtime import RuntimeConfig
from transformer.translator import Translator


@dataclass
class AlignmentConfig:
    checkpoint: str = "???"
    ensemble: list[str] = field(default_factory=list)
    gold: str = "tests/data/alignment/test_2016_flickr_de_en"
    device: str = "auto"
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


def read_gold(stem: Path, src_lang: str, tgt_lang: str) -> tuple[list[str], list[str], list[set]]:
    sources, targets = read_parallel(stem.with_suffix(f".{src_lang}"), stem.with_suffix(f".{tgt_lang}"))
    links = [read_pharaoh(line) for line in read_lines(stem.with_suffix(".align"))]
    if len(links) != len(sources):
        raise DataError(f"{stem}.align has {len(links)} lines, {stem}.{src_lang} has {len(sources)}")
    return sources, targets, links


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, AlignmentConfig, __doc__)
        translator = Translator.load(cfg.checkpoint, cfg.ensemble, cfg.device, runtime=cfg.runtime)
        model, tokenizer, device = translator.model, translator.tokenizer, translator.device
        data = translator.payload.get("train_config", {}).get("data", {})
        sources, targets, gold = read_gold(Path(cfg.gold), data.get("src_lang", "de"), data.get("tgt_lang", "en"))
        src_ids, tgt_ids = tokenizer.source.encode(sources), tokenizer.encode(targets)
        print(f"{len(gold)} sentence pairs, {sum(len(g) for g in gold)} gold links; {cfg.checkpoint}")
        print("| decoder layer | target piece aligned by | precision | recall | AER |\n|---|---|---:|---:|---:|")
        for layer in range(transformers(model)[0].cfg.n_decoder_layers):
            for shift, step in ((False, "the step that predicts it"), (True, "the step that reads it")):
                links = align(model, tokenizer, src_ids, tgt_ids, layer, device, shift)
                precision, recall, aer = alignment_error([set(x) for x in links], gold)
                print(f"| {layer} | {step} | {precision:.3f} | {recall:.3f} | {aer:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
