"""Scoring given translations (decoding/corpus.py: score_ids, Translator.score, translate.py
score=true): the searches' own scores of what they generated, the same alone and batched with
padding, under both runtimes and for ensembles; translate.py writes them per line."""

from __future__ import annotations

import pytest
import torch

from transformer.decoding import DecodeConfig, Ensemble, translate_ids
from transformer.decoding.corpus import score_ids
from transformer.errors import DataError
from transformer.fast import accelerate
from transformer.runtime import RuntimeConfig

from .conftest import BOS, EOS, PAD
from .servers import build_checkpoint, loaded_translator, translate_py
from .test_decoding import make_model, sources


class Ids:
    bos_id, eos_id, pad_id = BOS, EOS, PAD


@pytest.mark.isa
@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_a_translation_scores_what_the_search_that_made_it_scored(fast, strategy):
    """A search's log-probability of its own output is the sum of score_ids' per-token
    log-probabilities of it, EOS included, whatever the batch it is scored in."""
    model = accelerate(make_model(), RuntimeConfig(fast=fast))
    src = sources(24)
    cfg = DecodeConfig(strategy=strategy, beam_size=3, max_tokens=64)  # several batches
    best = [n_best[0] for n_best in translate_ids(model, src, Ids, cfg, "cpu")]
    scored = score_ids(model, src, [h.tokens for h in best], Ids, cfg, "cpu")
    assert [len(lp) for lp in scored] == [len(h.tokens) + 1 for h in best]
    assert [sum(lp) for lp in scored] == pytest.approx([h.log_prob for h in best], abs=1e-4)
    alone = [score_ids(model, [s], [h.tokens], Ids, cfg, "cpu")[0] for s, h in zip(src[:6], best)]
    for a, b in zip(alone, scored):
        assert a == pytest.approx(b, abs=1e-5)


def test_an_ensemble_scores_with_its_mean_distribution():
    models = [make_model(seed) for seed in (0, 1)]
    src, cfg = sources(6), DecodeConfig(strategy="greedy")
    best = [n[0] for n in translate_ids(Ensemble(models), src, Ids, cfg, "cpu")]
    scored = score_ids(Ensemble(models), src, [h.tokens for h in best], Ids, cfg, "cpu")
    assert [sum(lp) for lp in scored] == pytest.approx([h.log_prob for h in best], abs=1e-4)
    single = score_ids(models[0], src, [h.tokens for h in best], Ids, cfg, "cpu")
    assert [sum(lp) for lp in scored] != pytest.approx([sum(lp) for lp in single], abs=1e-3)


@pytest.mark.e2e
def test_translate_py_scores_each_line_and_names_a_bad_one(tmp_path):
    path = build_checkpoint(tmp_path / "model.pt")
    translator = loaded_translator(path)
    sources = ["Ein Hund läuft.", "Zwei Männer sitzen auf einer Bank."]
    translations = translator.translate(sources)
    lines = f"{sources[0]}\t{translations[0]}\n\n{sources[1]}\t{translations[1]}\n"
    done = translate_py(f"checkpoint={path}", "device=cpu", "decode=greedy", "score=true", stdin=lines)
    assert done.returncode == 0, done.stderr
    got = done.stdout.split("\n")[:3]
    expected = [sum(lp) for lp in translator.score(sources, translations)]
    assert got[1] == "" and [float(got[0]), float(got[2])] == pytest.approx(expected, abs=2e-4)
    with pytest.raises(DataError, match="texts:2:"):  # too long to end within the model's positions
        translator.score(["Ein Hund.", "Ein Hund."], ["A dog.", "A dog. " * 100], source_name="texts")
    bad = translate_py(f"checkpoint={path}", "score=true", stdin="Ein Hund.\n")
    assert bad.returncode != 0 and "stdin:1: expected source<TAB>translation" in bad.stderr
    assert "Traceback" not in bad.stderr
    clash = translate_py(f"checkpoint={path}", "score=true", "prefix=true", stdin="x\ty\n")
    assert clash.returncode != 0 and "score=true scores given translations" in clash.stderr


def test_scoring_under_bf16_keeps_fp32_log_probabilities():
    model = make_model()
    src = sources(4)
    targets = [[5, 6, 7], [8], [9, 10], []]
    scored = score_ids(model, src, targets, Ids, DecodeConfig(), "cpu", precision="bf16")
    fp32 = score_ids(model, src, targets, Ids, DecodeConfig(), "cpu")
    assert all(isinstance(x, float) for lp in scored for x in lp)
    for a, b in zip(scored, fp32):
        assert a == pytest.approx(b, abs=0.3)  # bf16 products on a model with sharp distributions
    assert torch.tensor([sum(lp) for lp in fp32]).isfinite().all()
