"""Lexically constrained beam search (constrained.py): the best translation of every sentence
contains its phrases, with the cache, without it and with ensembles; unconstrained sentences in
the same batch decode as plain beam search; the progress through phrases and the allocation of
beams to banks behave as documented; bad constraint input is refused with its line."""

import pytest

from transformer.decoding import DecodeConfig, Ensemble, Uncached, beam_search
from transformer.decoding.constrained import Candidate, Progress, allocate, constrained_beam_search
from transformer.decoding.corpus import translate_texts
from transformer.decoding.inputs import split_constraints
from transformer.errors import ConfigError, DataError

from .conftest import BOS, EOS
from .test_decoding import batch, char_tokenizer, make_model, sources

PHRASES = [[[5, 6]], [[7], [8, 9, 10]], [], [[11]], [[12, 13]], [[4, 4, 4]]]


def contains(tokens: list[int], phrase: list[int]) -> bool:
    return any(tokens[i : i + len(phrase)] == phrase for i in range(len(tokens)))


@pytest.mark.parametrize("wrap", ["cached", "uncached", "ensemble"])
def test_the_best_translation_contains_every_phrase(wrap):
    model = make_model()
    model = {"cached": model, "uncached": Uncached(model), "ensemble": Ensemble([model, make_model(seed=1)])}[wrap]
    n_best = constrained_beam_search(model, batch(sources(6)), BOS, EOS, DecodeConfig(beam_size=4, n_best=2), PHRASES)
    for hyps, phrases in zip(n_best, PHRASES):
        assert len(hyps) == 2 and all(contains(hyps[0].tokens, p) for p in phrases) and EOS not in hyps[0].tokens


def test_cached_constrained_search_equals_full_recomputation():
    model, src, cfg = make_model(), batch(sources(6)), DecodeConfig(beam_size=3, n_best=3)
    cached = constrained_beam_search(model, src, BOS, EOS, cfg, PHRASES)
    uncached = constrained_beam_search(Uncached(model), src, BOS, EOS, cfg, PHRASES)
    assert [[h.tokens for h in b] for b in cached] == [[h.tokens for h in b] for b in uncached]


@pytest.mark.parametrize("min_len", [0, 3])
def test_without_constraints_the_search_is_plain_beam_search(min_len):
    """With no phrase, one bank takes the k best and EOS ends a hypothesis among the k best:
    plain beam search's rules, so the same n-best lists, even beside constrained sentences."""
    model, src, cfg = make_model(), batch(sources(10)), DecodeConfig(beam_size=4, n_best=3, min_len=min_len)
    plain = beam_search(model, src, BOS, EOS, cfg)
    alone = constrained_beam_search(model, src, BOS, EOS, cfg, [[]] * 10)
    assert [[h.tokens for h in b] for b in alone] == [[h.tokens for h in b] for b in plain]
    mixed = constrained_beam_search(model, src, BOS, EOS, cfg, PHRASES + [[]] * 4)
    assert [[h.tokens for h in b] for b in mixed[6:]] == [[h.tokens for h in b] for b in plain[6:]]


def test_progress_through_phrases():
    phrases = [[5, 6, 7], [9]]
    p = Progress().after(5, phrases).after(6, phrases)
    assert (p.phrase, p.position, p.tokens_met(phrases), p.wanted(phrases)) == (0, 2, 2, [7])
    abandoned = p.after(8, phrases)
    assert abandoned == Progress() and abandoned.wanted(phrases) == [5, 9]
    restarted = p.after(5, phrases)  # not continued, but the token starts the same phrase again
    assert (restarted.phrase, restarted.position) == (0, 1)
    done = p.after(7, phrases).after(9, phrases)
    assert done.complete(phrases) and done.tokens_met(phrases) == 4 and done.wanted(phrases) == []


def test_beams_go_to_the_banks_in_turns_from_the_most_constraint_tokens_down():
    phrases = [[5, 6]]
    banks = {0: Progress(), 1: Progress(frozenset(), 0, 1), 2: Progress(frozenset({0}))}
    cands = [Candidate(-float(i), i, 20 + i, banks[bank]) for i, bank in enumerate([0, 0, 0, 0, 1, 2])]
    chosen = allocate(cands, 4, phrases)
    assert [c.progress.tokens_met(phrases) for c in chosen] == [2, 1, 0, 0]  # the empty banks give their turns
    assert [c.beam for c in chosen] == [5, 4, 0, 1]  # the best of each bank first


def test_constraint_lines_and_settings_are_checked():
    lines = ["ein hund\ta dog\truns", "zwei katzen", ""]
    assert split_constraints(lines, "in") == (["ein hund", "zwei katzen", ""], [["a dog", "runs"], [], []])
    with pytest.raises(DataError, match="in:2: expected source<TAB>phrase<TAB>..., found an empty phrase"):
        split_constraints(["a\tb", "x\t\ty"], "in")
    tokenizer = char_tokenizer()
    model = make_model(vocab_size=len(tokenizer))
    with pytest.raises(ConfigError, match="constraints need decode.strategy=beam, not greedy"):
        translate_texts(model, ["hund"], tokenizer, DecodeConfig(strategy="greedy"), "cpu", constraints=[["a"]])


def test_detokenized_translations_contain_the_phrases():
    tokenizer = char_tokenizer()
    model = make_model(vocab_size=len(tokenizer))
    texts, phrases = ["ein hund", "zwei katzen", "hund"], [["a dog"], [], ["zwei", "runs"]]
    n_best = translate_texts(model, texts, tokenizer, DecodeConfig(beam_size=4), "cpu", constraints=phrases)
    for hyps, wanted in zip(n_best, phrases):
        assert all(phrase in tokenizer.decode([hyps[0].tokens])[0] for phrase in wanted)
