"""The paged key/value cache (fast/paged.py) and the continuous-batching engine on it
(decoding/engine.py): block tables, forks and copy-on-write; a step over sequences at different
positions gives the reference model's own incremental logits; sentences that join and leave a
running batch get translate_ids' translations, greedy and beam, for the model variants the
engine runs (the default recipe's block among them), and under bf16 too; a full pool makes
sentences wait, and a pool a quarter of the need preempts and still translates every sentence the
same; a cancelled sentence gives its blocks back; sentences arriving and cancelled at random
steps all end; a sentence whose encoder pass fails leaves with its blocks returned while the
batch runs on."""

from __future__ import annotations

import random

import pytest
import torch

from transformer.decoding import DecodeConfig
from transformer.decoding.engine import AdmissionFailed, Engine, Sentence
from transformer.fast import accelerate, paged
from transformer.fast.paged import BlockPool
from transformer.model import DecoderLayer, padding_mask
from transformer.runtime import RuntimeConfig
from transformer.translator import Translator

from .briefly_trained import multi30k_corpus, trained_model
from .conftest import make_model, random_tokens

RECIPE = {"positional": "rope", "norm": "rmsnorm", "activation": "swiglu", "norm_first": True}  # model=small_modern
VARIANTS = [
    {},
    {"positional": "rope", "norm_first": True},
    {"positional": "learned", "n_kv_heads": 2},
    RECIPE,
    {**RECIPE, "n_kv_heads": 2},
]
VARIANT_IDS = ["paper", "rope-prenorm", "learned-gqa", "recipe", "recipe-gqa"]


@pytest.fixture(scope="module")
def corpus():
    return multi30k_corpus()


@pytest.fixture(scope="module")
def accelerated(corpus):
    """trained_model(corpus, variant, steps=60) with the default runtime's speed paths, trained
    once per variant for the tests of this module that only read it."""
    models = {}

    def get(variant: dict):
        key = repr(sorted(variant.items()))
        if key not in models:
            model, tokenizer = trained_model(corpus, variant, steps=60)
            models[key] = accelerate(model, RuntimeConfig()), tokenizer
        return models[key]

    return get


def test_blocks_are_shared_by_forks_and_copied_on_write():
    pool = BlockPool(6, 2, layers=1, kv_heads=1, head_size=1, dtype=torch.float32, device="cpu")
    parent: list[int] = []
    for position in range(3):  # two blocks: [0, 1] full, [2] half
        slot, _ = pool.writable(parent, position)
        pool.keys[0, slot] = position + 1.0
    child = pool.share(parent)
    assert pool.refs[parent[0]] == pool.refs[parent[1]] == 2
    slot, taken = pool.writable(child, 3)  # the shared half-full block is copied before the write
    assert taken and child[1] != parent[1] and child[0] == parent[0]
    pool.keys[0, slot] = 40.0
    assert pool.keys[0, pool.slots([child], 4)[0], 0, 0].tolist() == [1.0, 2.0, 3.0, 40.0]
    assert pool.keys[0, pool.slots([parent], 3)[0], 0, 0].tolist() == [1.0, 2.0, 3.0]
    assert pool.most_used == 3
    pool.release(parent)
    pool.release(child)
    assert sorted(pool.free) == list(range(6))
    pool.writable([], 0)
    assert pool.most_used == 3  # the most in use at once, not now


@pytest.mark.isa
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("runtime", ["reference", "fast"])
def test_a_step_over_rows_at_different_positions_gives_the_reference_logits(variant, runtime):
    """Two sentences decoded by the reference incrementally, one of them starting two steps later
    with two forked beams: every paged step gives each row the reference's logits."""
    torch.manual_seed(0)
    model = make_model(runtime, **variant)
    reference = make_model("reference", **variant)
    reference.load_state_dict(model.state_dict())
    src = random_tokens(2, 7)
    src[1, 5:] = model.cfg.pad_id
    targets = random_tokens(2, 6)
    src_mask = padding_mask(src, model.cfg.pad_id)
    with torch.no_grad():
        expected = reference.decode(targets, reference.encode(src, src_mask)[0], src_mask)[0]  # (2, 6, vocab)
        memory = model.encode(src, src_mask)[0]
    lengths = [7, 5]
    pool = BlockPool(32, 2, *paged.pool_shape(model), torch.float32, "cpu")
    cross = [[pool.allocate() for _ in range(pool.blocks_for(n))] for n in lengths]
    paged.store_memory(model, pool, memory, lengths, cross)
    rows = [([], 0, 0)]  # (table, sentence, position)
    for step in range(6):
        if step == 2:  # the second sentence joins, as two beams that will share its first block
            rows.append(([], 1, 0))
        if step == 3:
            rows.append((pool.share(rows[1][0]), 1, rows[1][2]))
        slots = [pool.writable(table, pos)[0] for table, _, pos in rows]
        longest = max(pos for _, _, pos in rows) + 1
        width = 1 + (len(rows) == 3)
        fold = [0] + ([width, width + 1][: len(rows) - 1])
        as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        state = paged.PagedState(
            pool,
            positions=as_long([pos for _, _, pos in rows]),
            write_slots=as_long(slots),
            self_slots=pool.slots([t for t, _, _ in rows], longest),
            self_lengths=as_long([pos + 1 for _, _, pos in rows]),
            memory=paged.PagedMemory(pool, pool.slots(cross, 7), lengths, torch.float32),
            fold=as_long(fold),
            width=width,
        )
        tokens = as_long([targets[s, pos] for _, s, pos in rows])[:, None]
        with torch.no_grad():
            logits = model.decode(tokens, None, src_mask, state)[0][:, 0]
        for row, (_, s, pos) in enumerate(rows):
            torch.testing.assert_close(logits[row], expected[s, pos], rtol=1e-4, atol=1e-4)
        rows = [(t, s, pos + 1) for t, s, pos in rows]


def run_engine(engine: Engine, sources, settings, join_every: int = 2) -> list:
    """The sentences join a running batch two at a time, one step apart."""
    out = [None] * len(sources)
    pending = list(enumerate(sources))
    steps = 0
    while pending or engine.busy:
        if pending and steps % join_every == 0:
            for i, ids in pending[:2]:
                engine.add(Sentence(ids + [engine.tokenizer.eos_id], settings, lambda nb, i=i: out.__setitem__(i, nb)))
            pending = pending[2:]
        engine.step(join_tokens=4096)
        steps += 1
    return out


@pytest.mark.isa
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_sentences_joining_a_running_batch_get_translate_ids_translations(accelerated, corpus, variant, strategy):
    model, tokenizer = accelerated(variant)
    settings = DecodeConfig(strategy=strategy, beam_size=4, n_best=2 if strategy == "beam" else 1)
    translator = Translator(model, tokenizer, "cpu", settings)
    sources = translator.encode(corpus[0][:10])
    expected = translator.translate_ids(sources, settings)
    engine = Engine(model, tokenizer, settings, "cpu", pool_bytes=1 << 20, block_size=4)
    got = run_engine(engine, sources, settings)
    assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in expected]
    for hyps, ref in zip(got, expected):
        assert [h.score for h in hyps] == pytest.approx([h.score for h in ref], abs=1e-4)
    assert sorted(engine.pool.free) == list(range(engine.pool.n_blocks))


@pytest.mark.isa
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_bf16_continuous_batching_gets_the_corpus_decoders_bf16_translations(accelerated, corpus, strategy):
    """Under runtime.precision=bf16 with runtime.fp32_cross (the default) the corpus decoder attends
    to the encoder's keys and values in fp32; the paged step must too, or its scores part from
    the corpus decoder's (and then its beams and translations)."""
    model, tokenizer = accelerated({})
    settings = DecodeConfig(strategy=strategy, beam_size=4, n_best=2 if strategy == "beam" else 1)
    translator = Translator(model, tokenizer, "cpu", settings, precision="bf16")
    sources = translator.encode(corpus[0][:6])
    expected = translator.translate_ids(sources, settings)
    engine = Engine(model, tokenizer, settings, "cpu", pool_bytes=1 << 20, block_size=4, precision="bf16")
    got = run_engine(engine, sources, settings)
    assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in expected]
    for hyps, ref in zip(got, expected):
        assert [h.score for h in hyps] == pytest.approx([h.score for h in ref], abs=1e-4)
        assert [h.log_prob for h in hyps] == pytest.approx([h.log_prob for h in ref], abs=1e-4)


def test_a_full_pool_makes_sentences_wait_and_never_fail(corpus):
    """A pool that holds the longest sentence alone at its worst: the sentences take turns, and
    those that joined last give their blocks back when it runs dry and start again; every one
    gets translate_ids' translation."""
    model, tokenizer = trained_model(corpus, {}, steps=60)
    settings = DecodeConfig(strategy="beam", beam_size=4)
    translator = Translator(model, tokenizer, "cpu", settings)
    sources = translator.encode(corpus[0][:8])
    expected = translator.translate_ids(sources, settings)
    engine = Engine(model, tokenizer, settings, "cpu", pool_bytes=1, block_size=4)  # at least one block: grown below
    longest = max(sources, key=len)
    probe = Sentence(longest + [tokenizer.eos_id], settings, lambda nb: None)
    with pytest.raises(ValueError, match="raise scheduler.pool_mib"):
        engine.add(probe)  # one block can never hold it
    per_block = engine.pool.keys[:, :4].nbytes * 2
    engine = Engine(model, tokenizer, settings, "cpu", pool_bytes=engine.need(probe) * per_block, block_size=4)
    out = [None] * len(sources)
    for i, ids in enumerate(sources):
        engine.add(Sentence(ids + [tokenizer.eos_id], settings, lambda nb, i=i: out.__setitem__(i, nb)))
    while engine.busy:
        engine.step(join_tokens=4096)
    assert engine.most_running < len(sources)  # they took turns
    assert [h[0].tokens for h in out] == [h[0].tokens for h in expected]
    assert sorted(engine.pool.free) == list(range(engine.pool.n_blocks))


def test_a_pool_a_quarter_of_the_need_preempts_and_translates_every_sentence_the_same(corpus):
    """Blocks are taken as sentences grow, so more sentences run at once than worst-case
    reservation would let in; when the pool runs dry, preempted sentences start again later and
    their translations are unchanged (n-best lists and scores included)."""
    model, tokenizer = trained_model(corpus, {}, steps=60)
    settings = DecodeConfig(strategy="beam", beam_size=4, n_best=2)
    translator = Translator(model, tokenizer, "cpu", settings)
    sources = translator.encode(corpus[0][:16])
    expected = translator.translate_ids(sources, settings)
    probe = Engine(model, tokenizer, settings, "cpu", pool_bytes=1, block_size=4)
    needs = []
    for ids in sources:
        sentence = Sentence(ids + [tokenizer.eos_id], settings, lambda nb: None)
        sentence.max_len = probe.length_limit(len(sentence.ids), settings)
        needs.append(probe.need(sentence))
    per_block = probe.pool.keys[:, :4].nbytes * 2
    blocks = max(max(needs), sum(needs) // 4)
    engine = Engine(model, tokenizer, settings, "cpu", pool_bytes=blocks * per_block, block_size=4)
    out = [None] * len(sources)
    for i, ids in enumerate(sources):
        engine.add(Sentence(ids + [tokenizer.eos_id], settings, lambda nb, i=i: out.__setitem__(i, nb)))
    while engine.busy:
        engine.step(join_tokens=4096)
    reserved_at_once = blocks // max(needs)  # what worst-case reservation would have run together
    assert engine.preemptions > 0 and engine.most_running > reserved_at_once
    assert [[h.tokens for h in hyps] for hyps in out] == [[h.tokens for h in hyps] for hyps in expected]
    for hyps, ref in zip(out, expected):
        assert [h.score for h in hyps] == pytest.approx([h.score for h in ref], abs=1e-4)
    assert sorted(engine.pool.free) == list(range(engine.pool.n_blocks))


def test_a_cancelled_sentence_leaves_and_gives_its_blocks_back(corpus):
    model, tokenizer = trained_model(corpus, {}, steps=60)
    settings = DecodeConfig(strategy="beam", beam_size=3)
    engine = Engine(model, tokenizer, settings, "cpu", pool_bytes=1 << 20, block_size=4)
    gone, answered = False, []
    ids = Translator(model, tokenizer, "cpu", settings).encode(corpus[0][:2])
    engine.add(Sentence(ids[0] + [tokenizer.eos_id], settings, answered.append, cancelled=lambda: gone))
    engine.add(Sentence(ids[1] + [tokenizer.eos_id], settings, answered.append))
    engine.step(4096)
    engine.step(4096)
    assert len(engine.running) == 2
    gone = True
    engine.step(4096)
    assert len(engine.running) == 1
    while engine.busy:
        engine.step(4096)
    assert len(answered) == 1 and sorted(engine.pool.free) == list(range(engine.pool.n_blocks))


def test_a_sentence_whose_encoder_pass_fails_leaves_with_its_blocks_and_the_batch_runs_on(
    accelerated, corpus, monkeypatch
):
    model, tokenizer = accelerated({})
    settings = DecodeConfig(strategy="beam", beam_size=3)
    engine = Engine(model, tokenizer, settings, "cpu", pool_bytes=1 << 20, block_size=4)
    ids = Translator(model, tokenizer, "cpu", settings).encode(corpus[0][:2])
    answered = []
    engine.add(Sentence(ids[0] + [tokenizer.eos_id], settings, answered.append))
    engine.step(4096)
    engine.add(Sentence(ids[1] + [tokenizer.eos_id], settings, answered.append))

    def broken(*args, **kwargs):
        raise RuntimeError("the encoder broke")

    monkeypatch.setattr(model, "encode", broken)
    with pytest.raises(AdmissionFailed, match="the encoder broke") as failed:
        while engine.waiting:  # it joins within JOIN_STEPS steps
            engine.step(4096)
    assert [s.ids for s in failed.value.sentences] == [ids[1] + [tokenizer.eos_id]]
    assert not engine.waiting and len(engine.running) == 1
    held = {block for s in engine.running for table in [s.cross] + [row.table for row in s.rows] for block in table}
    assert engine.pool.n_blocks - len(engine.pool.free) == len(held)  # the failed sentence's blocks came back
    monkeypatch.undo()
    while engine.busy:
        engine.step(4096)
    assert len(answered) == 1 and sorted(engine.pool.free) == list(range(engine.pool.n_blocks))


def test_the_engine_decodes_through_the_models_own_decoder_layers(accelerated, corpus, monkeypatch):
    """No second layer forward: every engine step runs DecoderLayer.forward once per layer, on
    the paged caches."""
    model, tokenizer = accelerated({})
    settings = DecodeConfig(strategy="beam", beam_size=3)
    calls = []
    forward = DecoderLayer.forward

    def counted(layer, x, memory, src_mask, tgt_mask, cache=None, need_weights=False):
        calls.append(type(cache.self).__name__)
        return forward(layer, x, memory, src_mask, tgt_mask, cache, need_weights)

    monkeypatch.setattr(DecoderLayer, "forward", counted)
    engine = Engine(model, tokenizer, settings, "cpu", pool_bytes=1 << 20, block_size=4)
    sources = Translator(model, tokenizer, "cpu", settings).encode(corpus[0][:3])
    run_engine(engine, sources, settings)
    assert calls and set(calls) == {"PagedKeyValueCache"}
    assert len(calls) == engine.steps * model.cfg.n_decoder_layers


def smallest_engine(model, tokenizer, base: DecodeConfig, sources: list[list[int]], settings: list[DecodeConfig]) -> Engine:  # fmt: skip
    """An engine (blocks of 4 positions) whose pool holds, alone, the sentence of `sources` that
    needs the most blocks at its own settings, and no more."""
    per_block = BlockPool.bytes_per_block(4, *paged.pool_shape(model), torch.float32)
    engine = Engine(model, tokenizer, base, "cpu", pool_bytes=per_block, block_size=4)
    probes = [Sentence(ids + [tokenizer.eos_id], s, lambda nb: None) for ids, s in zip(sources, settings)]
    for probe in probes:
        probe.max_len = engine.length_limit(len(probe.ids), probe.settings)
    return Engine(model, tokenizer, base, "cpu", pool_bytes=max(map(engine.need, probes)) * per_block, block_size=4)


def test_sentences_with_different_settings_share_a_small_pool_and_get_their_own_translations(accelerated, corpus):
    """Greedy and beam sentences of different beam sizes run side by side (as requests with their
    own settings do in the server), in a pool small enough to preempt: each gets translate_ids'
    translation under its own settings."""
    model, tokenizer = accelerated({})
    base = DecodeConfig(strategy="beam", beam_size=4)
    translator = Translator(model, tokenizer, "cpu", base)
    sources = translator.encode(corpus[0][:12])
    kinds = [DecodeConfig(strategy="greedy"), DecodeConfig(strategy="beam", beam_size=2), DecodeConfig(strategy="beam", beam_size=4, n_best=2)]  # fmt: skip
    settings = [kinds[i % 3] for i in range(len(sources))]
    expected = [translator.translate_ids([ids], s)[0] for ids, s in zip(sources, settings)]
    engine = smallest_engine(model, tokenizer, base, sources, settings)
    out = [None] * len(sources)
    for i, (ids, s) in enumerate(zip(sources, settings)):
        engine.add(Sentence(ids + [tokenizer.eos_id], s, lambda nb, i=i: out.__setitem__(i, nb)))
    while engine.busy:
        engine.step(join_tokens=4096)
    assert engine.preemptions > 0
    assert [[h.tokens for h in hyps] for hyps in out] == [[h.tokens for h in hyps] for hyps in expected]
    assert sorted(engine.pool.free) == list(range(engine.pool.n_blocks))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sentences_arriving_and_cancelled_at_random_steps_in_a_small_pool_all_end(accelerated, corpus, seed):
    """Sentences of mixed settings added at random steps (as requests arrive at a server), some
    cancelled at a random later step, in a pool that preempts: every sentence not cancelled gets
    translate_ids' translation, none waits forever, and every block comes back."""
    model, tokenizer = accelerated({})
    rng = random.Random(seed)
    base = DecodeConfig(strategy="beam", beam_size=4)
    translator = Translator(model, tokenizer, "cpu", base)
    sources = translator.encode(corpus[0][:14])
    kinds = [DecodeConfig(strategy="greedy"), DecodeConfig(strategy="beam", beam_size=2), DecodeConfig(strategy="beam", beam_size=4)]  # fmt: skip
    settings = [rng.choice(kinds) for _ in sources]
    expected = [translator.translate_ids([ids], s)[0] for ids, s in zip(sources, settings)]
    arrives = [rng.randrange(12) for _ in sources]
    cancelled_at = [at + rng.randrange(1, 6) if rng.random() < 0.3 else None for at in arrives]
    engine = smallest_engine(model, tokenizer, base, sources, settings)
    out, now = [None] * len(sources), {"step": 0}
    while now["step"] < 12 or engine.busy:
        for i, (ids, s) in enumerate(zip(sources, settings)):
            if arrives[i] == now["step"]:
                gone = lambda i=i: cancelled_at[i] is not None and now["step"] >= cancelled_at[i]  # noqa: E731
                engine.add(Sentence(ids + [tokenizer.eos_id], s, lambda nb, i=i: out.__setitem__(i, nb), gone))
        engine.step(join_tokens=rng.choice([8, 64, 4096]))
        now["step"] += 1
        assert now["step"] < 2000, "a sentence waits forever"
    for i, (hyps, ref) in enumerate(zip(out, expected)):
        if cancelled_at[i] is None or hyps is not None:  # a cancelled sentence may have ended first
            assert hyps is not None and [h.tokens for h in hyps] == [h.tokens for h in ref]
    assert engine.preemptions > 0 and any(at is not None and hyps is None for at, hyps in zip(cancelled_at, out))
    assert sorted(engine.pool.free) == list(range(engine.pool.n_blocks))
