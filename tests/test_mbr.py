"""Minimum Bayes risk reranking: the consensus wins, probabilities weigh the pseudo-references,
duplicates count once, and through translate_ids the beam's list is only reordered."""

import pytest
from sacrebleu.metrics import CHRF

from transformer import decoding
from transformer.decoding import DecodeConfig, Hypothesis
from transformer.decoding.mbr import expected_utilities, rerank, utility

from .conftest import BOS, EOS, PAD
from .test_decoding import make_model, sources


class Words:
    """Token ids as text, one word per id, with the special ids a decoder needs."""

    bos_id, eos_id, pad_id = BOS, EOS, PAD

    @staticmethod
    def decode(ids: list[list[int]]) -> list[str]:
        return [" ".join(f"w{t}" for t in sentence) for sentence in ids]


def hyps(n: int) -> list[Hypothesis]:
    return [Hypothesis([i], 0.0, 0.0) for i in range(n)]


def test_uniform_weights_choose_the_hypothesis_between_the_others():
    texts = ["a dog runs on the grass", "a dog runs on grass", "the dog is running on the green grass"]
    [reranked] = rerank([hyps(3)], [texts], "chrf", "uniform")
    assert reranked[0].tokens == [0]  # the middle one, not the first the beam ranked
    gains = expected_utilities(texts, [0.0] * 3, "uniform", utility("chrf"))
    chrf = CHRF()
    by_hand = [sum(chrf.sentence_score(h, [y]).score for y in texts) / 3 for h in texts]
    assert gains == pytest.approx(by_hand)
    assert [h.tokens[0] for h in reranked] == sorted(range(3), key=lambda i: -by_hand[i])


def test_a_hypothesis_with_almost_all_the_probability_wins():
    texts = ["a dog runs on grass", "a dog runs on the grass", "a dog runs on the grass ."]
    [reranked] = rerank([hyps(3)], [texts], "bleu", "model")
    assert reranked[0].tokens == [1]  # the consensus under uniform weights
    heavy = [Hypothesis([i], 0.0, lp) for i, lp in enumerate([0.0, -40.0, -40.0])]
    [reranked] = rerank([heavy], [texts], "bleu", "model")
    assert reranked[0].tokens == [0]


def test_duplicate_texts_pool_their_weight_and_get_the_same_gain():
    texts = ["a cat", "a dog on grass", "a dog on grass"]
    gains = expected_utilities(texts, [0.0, -0.1, -0.1], "model", utility("chrf"))
    assert gains[1] == gains[2] > gains[0]
    assert expected_utilities(["x y", "x y"], [0.0, -5.0], "model", utility("bleu")) == pytest.approx([100.0, 100.0])


def test_ties_and_single_hypotheses_keep_the_beams_order():
    same = ["a dog", "a dog", "a dog"]
    assert [h.tokens for h in rerank([hyps(3)], [same], "chrf", "model")[0]] == [[0], [1], [2]]
    assert rerank([hyps(1)], [["a dog"]], "chrf", "model")[0][0].tokens == [0]


def test_translate_ids_with_mbr_reorders_the_beams_list_by_expected_utility():
    model, sents = make_model(), sources(12)
    beam = decoding.translate_ids(model, sents, Words, DecodeConfig(beam_size=4, n_best=4), "cpu")
    mbr = decoding.translate_ids(model, sents, Words, DecodeConfig(beam_size=4, n_best=4, mbr="chrf"), "cpu")
    top = decoding.translate_ids(model, sents, Words, DecodeConfig(beam_size=4, mbr="chrf"), "cpu")
    metric, changed = utility("chrf"), 0
    for b, m, t in zip(beam, mbr, top):
        assert sorted(h.tokens for h in m) == sorted(h.tokens for h in b)  # the same hypotheses
        texts = Words.decode([h.tokens for h in m])
        gains = expected_utilities(texts, [h.log_prob for h in m], "model", metric)
        assert gains == sorted(gains, reverse=True)
        assert len(t) == 1 and t[0].tokens == m[0].tokens
        changed += m[0].tokens != b[0].tokens
    assert changed >= 1  # on this model MBR overrules the beam somewhere, so the test can fail


def test_mbr_config_is_checked_and_named():
    assert DecodeConfig(mbr="chrf").label == "beam5-mbr-chrf"
    assert DecodeConfig(mbr="bleu").greedy().label == "greedy"
    with pytest.raises(ValueError, match="decode.mbr"):
        DecodeConfig(mbr="ter")
    with pytest.raises(ValueError, match="decode.strategy=beam"):
        DecodeConfig(strategy="greedy", mbr="chrf")
    with pytest.raises(ValueError, match="decode.mbr"):
        DecodeConfig(mbr="chrf", mbr_weights="equal")
