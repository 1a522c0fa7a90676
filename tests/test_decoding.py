"""Decoding properties: every registered strategy translates a corpus, beam 1 == greedy, cached ==
uncached, batch-independence, sorted distinct n-best lists, seeded sampling, ensembles, loading
with a runtime and checkpoint averaging."""

from types import SimpleNamespace

import pytest
import torch

from transformer import checkpoint
from transformer import translator as translator_module
from transformer.data.batching import pad
from transformer.decoding import (
    STRATEGIES,
    DecodeConfig,
    Ensemble,
    Uncached,
    beam_search,
    generate,
    greedy,
    sampler,
    translate_ids,
)
from transformer.decoding import beam as beam_module
from transformer.decoding import search as search_module
from transformer.decoding.beam import best_extensions, stay_in_place
from transformer.decoding.config import SchedulerConfig
from transformer.fast import accelerate
from transformer.model import ModelConfig, Transformer
from transformer.runtime import RuntimeConfig
from transformer.translator import Translator

from .conftest import BOS, EOS, PAD

pytestmark = pytest.mark.isa  # runs again under each instruction-set limit (tests/isa_matrix.py)


def make_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=30, n_encoder_layers=2, n_decoder_layers=2, d_model=32, n_heads=4, d_ff=64, dropout=0.0)
    model = Transformer(ModelConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():  # sharper distributions than at initialization, so EOS comes at varied steps
        model.embed.embed.weight.mul_(3.0)
    return model


def sources(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (n,), generator=g).tolist()
    return [torch.randint(4, 30, (n_tok,), generator=g).tolist() for n_tok in lengths]


def batch(sents: list[list[int]]) -> torch.Tensor:
    return pad([s + [EOS] for s in sents], PAD)


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
def test_beam_size_one_equals_greedy(fast):
    model, src = accelerate(make_model(), RuntimeConfig(fast=fast)), batch(sources(16))
    cfg = DecodeConfig(beam_size=1, length_penalty=0.0)
    beams = beam_search(model, src, BOS, EOS, cfg)
    assert [b[0].tokens for b in beams] == greedy(model, src, BOS, EOS, cfg)


IDS = type("Ids", (), {"bos_id": BOS, "eos_id": EOS, "pad_id": PAD})()  # the special ids of a tokenizer


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_registered_strategy_translates_a_corpus(name):
    """Through the corpus entry point, each strategy gives every sentence the n-best list its
    registry entry promises, best first and without the EOS; a random strategy repeats with its seed."""
    model, sents = make_model(), sources(10)
    cfg = DecodeConfig(strategy=name, beam_size=3, n_best=2, max_tokens=40)  # several batches
    n_best = translate_ids(model, sents, IDS, cfg, "cpu")
    assert [len(hyps) for hyps in n_best] == [STRATEGIES[name].hypotheses_per_sentence(cfg)] * len(sents)
    for hyps in n_best:
        assert all(h.log_prob <= 0 and EOS not in h.tokens for h in hyps)
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    again = translate_ids(model, sents, IDS, cfg, "cpu")
    assert [[h.tokens for h in hyps] for hyps in again] == [[h.tokens for h in hyps] for hyps in n_best]
    assert cfg.label.startswith(name)


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_cached_decoding_equals_full_recomputation(n_kv_heads):
    model, src = make_model(n_kv_heads=n_kv_heads), batch(sources(8))
    cfg = DecodeConfig(beam_size=4)
    assert greedy(model, src, BOS, EOS, cfg) == greedy(Uncached(model), src, BOS, EOS, cfg)
    cached, uncached = beam_search(model, src, BOS, EOS, cfg), beam_search(Uncached(model), src, BOS, EOS, cfg)
    assert [b[0].tokens for b in cached] == [b[0].tokens for b in uncached]
    for a, b in zip(cached, uncached):
        assert a[0].score == pytest.approx(b[0].score, abs=1e-4)


def test_a_sentence_decodes_the_same_alone_and_in_a_padded_batch_of_64():
    model, sents = make_model(), sources(64)
    cfg = DecodeConfig(beam_size=5, n_best=3)
    together = beam_search(model, batch(sents), BOS, EOS, cfg)
    for i in (0, 17, 63):
        alone = beam_search(model, batch([sents[i]]), BOS, EOS, cfg)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in together[i]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in together[i]], abs=1e-4)


def test_dropping_finished_sentences_from_the_batch_changes_no_result(monkeypatch):
    model, src = make_model(), batch(sources(64))
    cfg = DecodeConfig(beam_size=4, n_best=2)
    prunes, worth_pruning = [], search_module.worth_pruning

    def counting(n_done: int, n_rows: int) -> bool:
        prunes.append(worth_pruning(n_done, n_rows))
        return prunes[-1]

    for module in (beam_module, search_module):
        monkeypatch.setattr(module, "worth_pruning", counting)
    pruned = beam_search(model, src, BOS, EOS, cfg), greedy(model, src, BOS, EOS, cfg)
    assert sum(prunes) >= 4  # both searches dropped sentences, more than once
    for module in (beam_module, search_module):
        monkeypatch.setattr(module, "worth_pruning", lambda n_done, n_rows: False)
    kept = beam_search(model, src, BOS, EOS, cfg), greedy(model, src, BOS, EOS, cfg)
    assert [[h.tokens for h in n_best] for n_best in pruned[0]] == [[h.tokens for h in n_best] for n_best in kept[0]]
    for a, b in zip(pruned[0], kept[0]):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)
    assert pruned[1] == kept[1]


class CountingSteps:
    """A model whose decode calls are counted, with the rows each one decodes."""

    def __init__(self, model):
        self.model, self.cfg, self.rows = model, model.cfg, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def decode(self, tgt, *args, **kwargs):
        self.rows.append(tgt.size(0))
        return self.model.decode(tgt, *args, **kwargs)


def test_greedy_stops_once_every_sentence_has_ended_and_batches_the_corpus():
    """Greedy decoding takes as many steps as the longest output has tokens, plus its EOS, and a
    corpus goes through in batches of many sentences, not one sentence at a time."""
    model, sents = CountingSteps(accelerate(make_model(), RuntimeConfig())), sources(32)
    out = greedy(model, batch(sents), BOS, EOS, DecodeConfig(max_len_b=50))
    assert len(model.rows) == max(len(tokens) for tokens in out) + 1
    model.rows.clear()
    translate_ids(model, sents, IDS, DecodeConfig(strategy="greedy", max_len_b=50), "cpu")
    assert model.rows[0] == len(sents) and len(model.rows) == max(len(tokens) for tokens in out) + 1


def test_bf16_decoding_runs_the_products_in_bf16_and_scores_in_fp32():
    model, sents = make_model(), sources(6)
    dtypes = []
    model.decoder_layers[0].ffn.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    cfg = DecodeConfig(beam_size=3, n_best=2)
    n_best = translate_ids(model, sents, IDS, cfg, "cpu", precision="bf16")
    assert dtypes and set(dtypes) == {torch.bfloat16}
    fp32 = translate_ids(model, sents, IDS, DecodeConfig(beam_size=3, n_best=2), "cpu")
    assert all(isinstance(h.score, float) and h.score <= 0 for hyps in n_best for h in hyps)
    # Rounding may change a close choice, but most sentences decode the same.
    same = sum(a[0].tokens == b[0].tokens for a, b in zip(n_best, fp32))
    assert same >= len(sents) // 2


def test_n_best_lists_are_sorted_distinct_and_scored_with_the_length_penalty():
    model = make_model()
    cfg = DecodeConfig(beam_size=6, n_best=6, length_penalty=1.0)
    for hyps in beam_search(model, batch(sources(12)), BOS, EOS, cfg):
        assert len(hyps) == 6
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 6
        for h in hyps:  # length counts the EOS
            assert h.score == pytest.approx(h.log_prob / ((5 + len(h.tokens) + 1) / 6))


def test_beam_search_stops_once_its_n_best_list_is_final(monkeypatch):
    """A sentence stops once it has n_best finished hypotheses that no live beam can beat: its
    n-best list is then what searching on until all beam_size had finished gives, in fewer steps."""
    model, src = make_model(), batch(sources(32))
    steps = []
    real_decode = model.decode

    def counting(*args, **kwargs):
        steps.append(args[0].size(0))  # rows decoded
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(model, "decode", counting)
    for n_best, alpha in ((1, 0.6), (1, 0.0), (2, 0.0)):
        steps.clear()
        early = beam_search(model, src, BOS, EOS, DecodeConfig(beam_size=5, n_best=n_best, length_penalty=alpha))
        rows_early = sum(steps)
        steps.clear()
        full = beam_search(model, src, BOS, EOS, DecodeConfig(beam_size=5, n_best=5, length_penalty=alpha))
        assert sum(steps) > rows_early
        assert [[h.tokens for h in hyps] for hyps in early] == [[h.tokens for h in hyps[:n_best]] for hyps in full]
        for a, b in zip(early, full):
            assert [h.score for h in a] == pytest.approx([h.score for h in b[:n_best]], abs=1e-4)


def test_beam_search_finds_at_least_the_greedy_score():
    model, src = make_model(), batch(sources(16))
    cfg = DecodeConfig(beam_size=8, length_penalty=0.0)
    greedy_hyps = generate(model, src, BOS, EOS, cfg, lambda lp: lp.argmax(-1))
    for beam, g in zip(beam_search(model, src, BOS, EOS, cfg), greedy_hyps):
        assert beam[0].log_prob >= g.log_prob - 1e-5


def test_max_length_rule_bounds_every_hypothesis():
    model, sents = make_model(), sources(10)
    cfg = DecodeConfig(beam_size=3, max_len_a=0.5, max_len_b=2)
    for sent, hyps in zip(sents, beam_search(model, batch(sents), BOS, EOS, cfg)):
        assert len(hyps[0].tokens) + 1 <= int((len(sent) + 1) * 0.5 + 2)


def test_min_len_forces_every_hypothesis_to_run_that_long():
    """With min_len = max_len - 1 every hypothesis has exactly max_len tokens (EOS last), the
    setting the decoding benchmark uses to give every decoder the same work."""
    model, sents = make_model(), sources(10)
    for name, strategy in STRATEGIES.items():
        cfg = DecodeConfig(strategy=name, beam_size=3, max_len_a=0.0, max_len_b=12, min_len=11)
        n_best = strategy.search(model, batch(sents), BOS, EOS, cfg, torch.Generator().manual_seed(0))
        assert [len(hyps[0].tokens) for hyps in n_best] == [11] * len(sents), name


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    model, src = make_model(), batch(sources(8))
    cfg = DecodeConfig(strategy="sample", temperature=1.5, top_p=0.9)

    def draw(seed):
        return [
            h.tokens for h in generate(model, src, BOS, EOS, cfg, sampler(cfg, torch.Generator().manual_seed(seed)))
        ]

    assert draw(5) == draw(5) and draw(5) != draw(6)
    top1 = DecodeConfig(strategy="sample", top_k=1)
    picks = generate(model, src, BOS, EOS, top1, sampler(top1, torch.Generator().manual_seed(0)))
    assert [h.tokens for h in picks] == greedy(model, src, BOS, EOS, top1)


def test_the_greedy_choice_is_argmax_with_ties_going_to_the_first_token():
    g = torch.Generator().manual_seed(0)
    lprobs = torch.randint(-3, 1, (64, 8000), generator=g).float()  # many tied maxima per row
    lprobs[5] = -torch.inf
    lprobs[6, 7999] = torch.inf
    assert torch.equal(search_module.argmax(lprobs), lprobs.argmax(-1))


def test_ensemble_of_one_model_twice_decodes_like_the_model():
    model, src = make_model(), batch(sources(8))
    cfg = DecodeConfig(beam_size=4)
    single, ensembled = (
        beam_search(model, src, BOS, EOS, cfg),
        beam_search(Ensemble([model, model]), src, BOS, EOS, cfg),
    )
    assert [b[0].tokens for b in single] == [b[0].tokens for b in ensembled]
    other = Ensemble([model, make_model(seed=1)])
    assert greedy(other, src, BOS, EOS, cfg) != greedy(model, src, BOS, EOS, cfg)


def char_tokenizer():
    from transformer.data.tokenizer import Tokenizer

    return Tokenizer.train(["ein hund läuft", "a dog runs", "zwei katzen"] * 20, vocab_size=30, model_type="char")


def test_the_translator_installs_the_runtime_and_precision_on_every_model_of_an_ensemble(tmp_path, monkeypatch):
    tokenizer = char_tokenizer()
    path = tmp_path / "model.pt"
    checkpoint.save(path, make_model(vocab_size=len(tokenizer)), tokenizer, train_config={}, step=1)
    installed, runtime = [], RuntimeConfig(fast=False, precision="int8")
    monkeypatch.setattr(translator_module, "accelerate", lambda model, runtime, int8: installed.append((model, runtime, int8)) or model)  # fmt: skip
    ensemble = Translator.load(path, [str(path)], "cpu", DecodeConfig(), runtime).model
    assert [model for model, _, _ in installed] == ensemble.models
    assert all(r is runtime and int8 for _, r, int8 in installed)


def test_averaging_copies_of_a_checkpoint_gives_the_same_weights(tmp_path):
    tokenizer = char_tokenizer()
    model = make_model(vocab_size=len(tokenizer))
    paths = [tmp_path / f"c{i}.pt" for i in range(3)]
    for path in paths:
        checkpoint.save(path, model, tokenizer, train_config={}, step=1)
    averaged = checkpoint.average(paths)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(averaged["model"][name], tensor, rtol=0, atol=0)
    other = make_model(seed=3, vocab_size=len(tokenizer))
    checkpoint.save(paths[1], other, tokenizer, train_config={}, step=2)
    mixed = checkpoint.average(paths[:2])["model"]["embed.embed.weight"]
    torch.testing.assert_close(mixed, (model.embed.embed.weight + other.embed.embed.weight) / 2)


def test_stay_in_place_permutes_survivors_and_keeps_every_parent_slot_it_can():
    torch.manual_seed(0)
    parents = torch.randint(0, 5, (200, 5))
    order = stay_in_place(parents)
    assert torch.equal(order.sort(1).values, torch.arange(5).expand(200, 5))  # a permutation per sentence
    placed = parents.gather(1, order)
    stayed = (placed == torch.arange(5)).sum(1)
    distinct = torch.tensor([len(set(row)) for row in parents.tolist()])
    assert torch.equal(stayed, distinct)  # every parent slot holds one of its children: the most possible


@pytest.mark.parametrize("sentences,width,vocab", [(64, 5, 8000), (3, 1, 8000), (7, 4, 1000), (2, 5, 97)])
def test_best_extensions_are_the_top_of_every_beam_score_plus_token_log_probability(sentences, width, vocab):
    torch.manual_seed(0)
    lprobs, scores = torch.randn(sentences * width, vocab).log_softmax(-1), torch.randn(sentences, width)
    lprobs[:, PAD] = -float("inf")
    lprobs[-1, :] = -float("inf")  # a row forced to end, as at its maximum length
    lprobs[-1, EOS] = -0.5
    top, index = best_extensions(scores, lprobs, 10)
    full = (scores.view(-1, 1) + lprobs).view(sentences, -1)
    expected = full.topk(10, dim=1)
    assert torch.equal(top, expected.values)
    assert torch.equal(full.gather(1, index), top)  # each index points at its score
    assert all(len(set(row)) == 10 for row in index.tolist())


class RowCounter:
    """A model wrapper that records the rows of every decoding step."""

    def __init__(self, model):
        self.model, self.cfg, self.rows = model, model.cfg, []

    def encode(self, src, src_mask):
        return self.model.encode(src, src_mask)

    def new_state(self):
        return self.model.new_state()

    def decode(self, tgt, memory, src_mask, state):
        self.rows.append(tgt.size(0))
        return self.model.decode(tgt, memory, src_mask, state)


@pytest.mark.parametrize("vocab_size", [30, 8])
def test_beam_search_expands_one_row_per_sentence_at_the_first_step(vocab_size):
    """The k beams would start identical. With fewer tokens than the 2k candidates a step keeps,
    the first step has all k rows, and the search still agrees with full recomputation."""
    model, src = make_model(vocab_size=vocab_size), batch([[t % vocab_size for t in s] for s in sources(6)])
    cfg = DecodeConfig(beam_size=5, n_best=2, min_len=3)
    counter = RowCounter(model)
    cached = beam_search(counter, src, BOS, EOS, cfg)
    assert counter.rows[:2] == ([6, 30] if vocab_size >= 10 else [30, 30])
    uncached = beam_search(Uncached(model), src, BOS, EOS, cfg)
    assert [[h.tokens for h in b] for b in cached] == [[h.tokens for h in b] for b in uncached]


@pytest.mark.parametrize("runtime", ["reference", "fast"])
def test_a_translator_decodes_in_its_precision_through_every_way_in(runtime):
    """The precision a Translator was loaded for (runtime.precision) reaches every way of decoding
    with it: texts, token ids, a corpus, scores, and a stream on the continuous engine."""
    tokenizer = char_tokenizer()
    model = accelerate(make_model(vocab_size=len(tokenizer)), RuntimeConfig(fast=runtime == "fast"))
    dtypes = []
    model.decoder_layers[0].ffn.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    settings = DecodeConfig(beam_size=2, max_len_a=0.0, max_len_b=4)
    translator = Translator(model, tokenizer, "cpu", settings, precision="bf16")
    texts = ["ein hund", "zwei katzen"]
    ways = {
        "translate": lambda: translator.translate(texts),
        "translate_texts": lambda: translator.translate_texts(texts),
        "translate_ids": lambda: translator.translate_ids(translator.encode(texts)),
        "translate_corpus": lambda: translator.translate_corpus(SimpleNamespace(src=translator.encode(texts))),
        "score": lambda: translator.score(texts, ["a dog", "cats"]),
        "translate_stream": lambda: translator.translate_stream(
            texts, lambda i, n_best: None, SchedulerConfig(kind="continuous", pool_mib=1)
        ),  # fmt: skip
    }
    for name, way in ways.items():
        dtypes.clear()
        way()
        assert dtypes and set(dtypes) == {torch.bfloat16}, name
