"""Target prefixes: every strategy's translations start with their sentence's prefix, with the cache,
without it and with ensembles; beam 1 with a prefix is greedy with it; an empty prefix is no prefix;
forcing what greedy search would choose anyway changes nothing; bad prefix input is refused."""

import pytest
import torch

from transformer.data.batching import pad
from transformer.decoding import STRATEGIES, DecodeConfig, Ensemble, Uncached, beam_search, greedy, translate_ids
from transformer.decoding.corpus import translate_texts
from transformer.decoding.inputs import split_prefixes
from transformer.errors import DataError

from .conftest import BOS, EOS
from .test_decoding import IDS, batch, char_tokenizer, make_model, sources


def prefixes(n: int, seed: int = 2) -> list[list[int]]:
    """Random prefixes of 0 to 5 tokens (never EOS or padding)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, 30, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def as_tensor(prefix_ids: list[list[int]]) -> torch.Tensor:
    return pad(prefix_ids, -1)


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("wrap", ["cached", "uncached", "ensemble"])
def test_every_hypothesis_starts_with_its_prefix(name, wrap):
    model = make_model()
    model = {"cached": model, "uncached": Uncached(model), "ensemble": Ensemble([model, make_model(seed=1)])}[wrap]
    sents, forced = sources(8), prefixes(8)
    cfg = DecodeConfig(strategy=name, beam_size=3, n_best=2 if name == "beam" else 1, max_tokens=30)
    n_best = translate_ids(model, sents, IDS, cfg, "cpu", prefixes=forced)
    for hyps, prefix in zip(n_best, forced):
        assert all(h.tokens[: len(prefix)] == prefix and EOS not in h.tokens for h in hyps)
        assert all(h.log_prob <= 0 for h in hyps)


def test_beam_size_one_with_a_prefix_equals_greedy_with_it():
    model, src, prefix = make_model(), batch(sources(16)), as_tensor(prefixes(16))
    cfg = DecodeConfig(beam_size=1, length_penalty=0.0)
    assert [b[0].tokens for b in beam_search(model, src, BOS, EOS, cfg, prefix)] == greedy(model, src, BOS, EOS, cfg, prefix)  # fmt: skip


def test_cached_beam_search_with_prefixes_equals_full_recomputation():
    model, src, prefix = make_model(), batch(sources(10)), as_tensor(prefixes(10))
    cfg = DecodeConfig(beam_size=4, n_best=4)
    cached, uncached = beam_search(model, src, BOS, EOS, cfg, prefix), beam_search(Uncached(model), src, BOS, EOS, cfg, prefix)  # fmt: skip
    assert [[h.tokens for h in b] for b in cached] == [[h.tokens for h in b] for b in uncached]


@pytest.mark.parametrize("name", ["greedy", "beam"])
def test_an_empty_prefix_is_no_prefix_even_beside_other_prefixes(name):
    model, sents = make_model(), sources(12)
    cfg = DecodeConfig(strategy=name, beam_size=3)
    plain = translate_ids(model, sents, IDS, cfg, "cpu")
    assert translate_ids(model, sents, IDS, cfg, "cpu", prefixes=[[]] * 12) == plain
    mixed = [p if i % 2 else [] for i, p in enumerate(prefixes(12))]
    with_some = translate_ids(model, sents, IDS, cfg, "cpu", prefixes=mixed)
    assert_same_translations(with_some[::2], plain[::2])


def assert_same_translations(got: list, expected: list) -> None:
    """The same n-best lists: equal tokens, and scores equal up to fp32 rounding. Beside other
    prefixes, sentences end at other steps, so the batch's products run on other numbers of rows,
    and some kernels round those differently (AVX2 on an AVX-512 Xeon: 2e-6 in 17)."""
    assert [[h.tokens for h in n_best] for n_best in got] == [[h.tokens for h in n_best] for n_best in expected]
    scores = [torch.tensor([[h.score for h in n_best] for n_best in side]) for side in (got, expected)]
    torch.testing.assert_close(*scores)


def test_forcing_what_greedy_search_chooses_anyway_changes_nothing():
    model, src = make_model(), batch(sources(12))
    cfg = DecodeConfig(strategy="greedy")
    free = greedy(model, src, BOS, EOS, cfg)
    own = as_tensor([tokens[:2] for tokens in free])  # within every source's length rule: the same limits
    assert greedy(model, src, BOS, EOS, cfg, own) == free


def test_a_prefix_longer_than_the_length_rule_is_kept_and_continued():
    model, src = make_model(), batch([[5, 6]] * 3)
    cfg = DecodeConfig(strategy="greedy", max_len_a=0.0, max_len_b=2)  # 2 tokens with EOS, without a prefix
    long = [[7] * 6, [8] * 3, []]
    out = greedy(model, src, BOS, EOS, cfg, as_tensor(long))
    for tokens, prefix in zip(out, long):
        assert tokens[: len(prefix)] == prefix and len(tokens) < len(prefix) + cfg.max_len_b


def test_detokenized_translations_start_with_the_prefix_text():
    tokenizer = char_tokenizer()
    model = make_model(vocab_size=len(tokenizer))
    texts, starts = ["ein hund", "zwei katzen", "", "hund"], ["a dog", "", "", "zwei k"]
    n_best = translate_texts(model, texts, tokenizer, DecodeConfig(beam_size=2), "cpu", prefixes=starts)
    outputs = tokenizer.decode([hyps[0].tokens for hyps in n_best])
    assert all(out.startswith(start) for out, start in zip(outputs, starts)) and outputs[2] == ""


def test_prefix_lines_need_one_tab_and_a_source():
    assert split_prefixes(["ein hund\ta dog", "", "zwei katzen \t two"], "in") == (["ein hund", "", "zwei katzen"], ["a dog", "", "two"])  # fmt: skip
    for line, problem in (("no tab here", "0 TABs"), ("a\tb\tc", "2 TABs"), (" \tprefix only", "an empty source")):
        with pytest.raises(DataError, match=f"in:2: expected source<TAB>prefix, found {problem}"):
            split_prefixes(["ok\tfine", line], "in")


def test_a_prefix_that_leaves_no_room_for_the_eos_is_refused():
    tokenizer = char_tokenizer()
    model = make_model(vocab_size=len(tokenizer), max_positions=16)
    with pytest.raises(DataError, match="in:2: the prefix has 15 tokens; the model fits at most 14"):
        translate_texts(
            model, ["hund"] * 2, tokenizer, DecodeConfig(), "cpu", source_name="in", prefixes=["a", "a" * 14]
        )
