"""Word alignments from cross-attention: attention that points each target piece at a source piece
gives exactly the word links it implies; every translated word gets one link inside both texts;
ensembles of one model, the uncached model and the cache agree; the gold file is well formed."""

import random

import pytest
import torch

from transformer.decoding import DecodeConfig, Ensemble, Uncached, translate_texts
from transformer.decoding.alignment import (
    align,
    align_translations,
    alignment_error,
    read_pharaoh,
    word_links,
    words_of_pieces,
)
from transformer.errors import ConfigError

from .conftest import ROOT
from .test_decoding import char_tokenizer, make_model

GOLD = ROOT / "tests" / "data" / "alignment" / "test_2016_flickr_de_en"


def segmentation(n_words: int, rng: random.Random) -> list[int]:
    """The word of each piece, for words of 1 to 3 pieces."""
    return [w for w in range(n_words) for _ in range(rng.randint(1, 3))]


@pytest.mark.parametrize("seed", range(5))
def test_attention_pointing_at_a_source_word_links_to_that_word(seed):
    """Each target word's pieces put nearly all their attention on pieces of the source word π(j):
    the links are exactly (π(j), j), whatever the segmentations."""
    rng = random.Random(seed)
    src_words, tgt_words = segmentation(rng.randint(1, 8), rng), segmentation(rng.randint(1, 8), rng)
    target_of = [rng.randrange(src_words[-1] + 1) for _ in range(tgt_words[-1] + 1)]
    attention = torch.full((len(tgt_words), len(src_words)), 0.01)
    for piece, word in enumerate(tgt_words):
        attention[piece, rng.choice([p for p, w in enumerate(src_words) if w == target_of[word]])] = 1.0
    assert word_links(attention, src_words, tgt_words) == [(i, j) for j, i in enumerate(target_of)]


def test_pieces_fall_in_the_words_of_their_detokenized_text():
    tokenizer = char_tokenizer()
    for text in ["ein hund läuft", "a  dog", "zwei", "hund a dog runs"]:
        ids = tokenizer.encode([text])[0]
        words = words_of_pieces(tokenizer, ids)
        assert words == sorted(words) and words[-1] + 1 == len(tokenizer.decode([ids])[0].split())


def test_every_translated_word_gets_one_link_within_both_texts():
    tokenizer = char_tokenizer()
    model = make_model(vocab_size=len(tokenizer), n_decoder_layers=3)
    texts = ["ein hund läuft", "zwei katzen", "", "a dog runs ein hund"]
    cfg = DecodeConfig(beam_size=3, n_best=2, alignment=True)
    n_best = translate_texts(model, texts, tokenizer, cfg, "cpu")
    alignments = align_translations(model, texts, n_best, tokenizer, cfg, "cpu")
    for text, hyps, links in zip(texts, n_best, alignments):
        assert len(links) == len(hyps)
        for hyp, line in zip(hyps, links):
            output = tokenizer.decode([hyp.tokens])[0].split()
            pairs = sorted(read_pharaoh(line), key=lambda p: p[1])
            assert [j for _, j in pairs] == list(range(len(output)))
            assert all(0 <= i < len(text.split()) for i, _ in pairs)


def test_an_ensemble_of_one_model_and_the_uncached_model_align_like_the_model():
    tokenizer = char_tokenizer()
    model = make_model(vocab_size=len(tokenizer))
    sources, targets = tokenizer.encode(["ein hund läuft", "zwei katzen"]), tokenizer.encode(["a dog runs", "two cats"])
    expected = align(model, tokenizer, sources, targets, -1, "cpu")
    assert align(Ensemble([model, model]), tokenizer, sources, targets, -1, "cpu") == expected
    assert align(Uncached(model), tokenizer, sources, targets, -1, "cpu") == expected
    with pytest.raises(ConfigError, match="decode.alignment_layer=2, but the decoder has 2 layers"):
        align(model, tokenizer, sources, targets, 2, "cpu")


def test_alignment_error_rate_of_perfect_empty_and_half_alignments():
    gold = [{(0, 0), (1, 1)}, {(0, 0)}]
    assert alignment_error(gold, gold) == (1.0, 1.0, 0.0)
    assert alignment_error([{(0, 0)}, set()], gold) == pytest.approx((1.0, 1 / 3, 1 - 2 / 4))
    assert alignment_error([{(1, 0), (0, 1)}, {(1, 0)}], gold)[2] == 1.0


def test_the_gold_alignments_are_inside_their_sentences():
    sources = GOLD.with_suffix(".de").read_text(encoding="utf-8").splitlines()
    targets = GOLD.with_suffix(".en").read_text(encoding="utf-8").splitlines()
    links = [read_pharaoh(line) for line in GOLD.with_suffix(".align").read_text().splitlines()]
    assert len(sources) == len(targets) == len(links) >= 20
    for src, tgt, pairs in zip(sources, targets, links):
        assert pairs and all(i < len(src.split()) and j < len(tgt.split()) for i, j in pairs)
