"""The lexical shortlist (transformer/decoding/shortlist.py): IBM Model 1 finds the piece a source
piece translates into; the file is CTranslate2's vocabulary map and reads back as written; the
shortlisted model keeps every candidate's logit and rules out the rest; searching its candidate
columns alone equals searching full rows; greedy search whose
translation lies within the candidates is unchanged; prefixes and constraints reach beyond the
shortlist; the commands build, use and export it, and refuse it where it cannot be used."""

import copy
import math

import pytest
import torch

from transformer.data.batching import pad
from transformer.data.corpus import DataError
from transformer.decoding import STRATEGIES, DecodeConfig, Ensemble, translate_ids
from transformer.decoding.shortlist import Shortlist, Shortlisted, ShortlistModel, build
from transformer.errors import ConfigError
from transformer.fast import accelerate
from transformer.runtime import RuntimeConfig

from .briefly_trained import multi30k_corpus, trained_model
from .conftest import RUNTIMES
from .test_bad_inputs import run_main, trained  # noqa: F401 (trained: a tiny de->en run, a fixture)
from .test_prefix import assert_same_translations


@pytest.fixture(scope="module")
def corpus():
    return multi30k_corpus()


@pytest.fixture(scope="module")
def tiny(corpus):
    return trained_model(corpus, {})


def specials(tokenizer) -> tuple[int, ...]:
    return tokenizer.eos_id, tokenizer.unk_id, tokenizer.bos_id


def test_ibm_model_1_finds_what_each_source_piece_translates_into():
    """Pairs where source piece s always comes with target piece s + 10, beside others that vary,
    and target piece 5 in every pair (the most frequent)."""
    generator = torch.Generator().manual_seed(0)
    sources, targets = [], []
    for _ in range(300):
        words = torch.randperm(8, generator=generator)[:3].add(1).tolist()  # source pieces 1..8
        sources.append(words)
        targets.append([w + 10 for w in words][::-1] + [5])
    shortlist = build(sources, targets, src_vocab=9, tgt_vocab=20, first=1, best=1, rounds=5)
    assert shortlist.fixed.tolist() == [5]
    assert shortlist.table[1:, 0].tolist() == [s + 10 for s in range(1, 9)]
    assert shortlist.table[0, 0] == -1  # never seen


def test_the_file_is_a_vocabulary_map_that_reads_back_and_names_a_foreign_piece(corpus, tmp_path):
    de, en, tokenizer, _ = corpus
    shortlist = build(tokenizer.source.encode(de), tokenizer.encode(en), len(tokenizer), len(tokenizer), first=20, best=4)  # fmt: skip
    path = tmp_path / "shortlist.tsv"
    shortlist.save(path, tokenizer.source.id_to_piece, tokenizer.id_to_piece)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("\t") and len(lines[0].split()) == 20  # the empty key: the frequent pieces
    assert all(len(line.split("\t")) == 2 and 1 <= len(line.split("\t")[1].split()) <= 4 for line in lines[1:])
    again = Shortlist.load(path, tokenizer)
    assert torch.equal(again.fixed, shortlist.fixed)
    rows = shortlist.table[:, 0] >= 0
    assert torch.equal(again.table[rows], shortlist.table[rows])
    path.write_text(lines[0] + "\n" + lines[1] + "\n▁Zyzzyva\t" + lines[1].split("\t")[1] + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"line 3: piece '▁Zyzzyva' is not in the model's vocabulary"):
        Shortlist.load(path, tokenizer)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_candidates_keep_their_logits_and_the_rest_are_ruled_out(tiny, corpus, runtime):
    model, tokenizer = tiny
    model = accelerate(copy.deepcopy(model), RuntimeConfig(fast=runtime == "fast"))
    src = torch.tensor([tokenizer.source.encode(corpus[0][0]) + [tokenizer.eos_id]])
    tgt = torch.tensor([[tokenizer.bos_id] + tokenizer.encode(corpus[1][0])])
    candidates = torch.tensor([3, 7, 20, 41, 100, 150])
    mask = src != tokenizer.pad_id
    with torch.no_grad():
        memory, _ = model.encode(src, mask[:, None, None, :])
        full, _ = model.decode(tgt, memory, mask[:, None, None, :])
        shortlisted = Shortlisted(model, candidates[None])
        cut, _ = shortlisted.decode(tgt, memory, mask[:, None, None, :], shortlisted.new_state())
    torch.testing.assert_close(cut[..., candidates], full[..., candidates])
    others = torch.ones(full.size(-1), dtype=torch.bool).index_fill_(0, candidates, False)
    assert bool((cut[..., others] == -math.inf).all())


def test_greedy_within_the_candidates_is_unchanged_and_beam_stays_within_them(tiny, corpus):
    """A shortlist whose frequent pieces hold every token of the full vocabulary's greedy
    translations leaves them as they were; beam search uses the candidates alone."""
    model, tokenizer = tiny
    sources = tokenizer.source.encode(corpus[0][:16])
    greedy = DecodeConfig(strategy="greedy")
    full = [h[0].tokens for h in translate_ids(model, sources, tokenizer, greedy, "cpu")]
    used = sorted({t for tokens in full for t in tokens})
    shortlist = Shortlist(torch.tensor(used), torch.full((len(tokenizer), 1), -1))
    shortlisted = ShortlistModel(model, shortlist, specials(tokenizer))
    assert [h[0].tokens for h in translate_ids(shortlisted, sources, tokenizer, greedy, "cpu")] == full
    allowed = set(used) | set(specials(tokenizer))
    narrow = Shortlist(torch.tensor(used[: len(used) // 2]), shortlist.table)
    for hyps in translate_ids(ShortlistModel(model, narrow, specials(tokenizer)), sources, tokenizer, DecodeConfig(), "cpu"):  # fmt: skip
        assert set(hyps[0].tokens) <= allowed
        assert set(hyps[0].tokens) <= set(used[: len(used) // 2]) | set(specials(tokenizer))


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_a_sentence_translates_alike_alone_and_among_others(tiny, corpus, strategy):
    """Each sentence keeps its own candidates: the batch's other sentences, whose candidates
    differ, do not widen them. (Decoding them all with the union of their candidates fails.)"""
    model, tokenizer = tiny
    de, en = corpus[0], corpus[1]
    shortlist = build(tokenizer.source.encode(de), tokenizer.encode(en), len(tokenizer), len(tokenizer), first=10, best=3)  # fmt: skip
    shortlisted = ShortlistModel(model, shortlist, specials(tokenizer))
    sources, cfg = tokenizer.source.encode(de[:12]), DecodeConfig(strategy=strategy)
    together = [h[0].tokens for h in translate_ids(shortlisted, sources, tokenizer, cfg, "cpu")]
    alone = [translate_ids(shortlisted, [s], tokenizer, cfg, "cpu")[0][0].tokens for s in sources]
    assert together == alone


@pytest.mark.parametrize("ensemble", [False, True], ids=["model", "ensemble"])
def test_searching_the_candidate_columns_equals_searching_full_rows(tiny, corpus, ensemble):
    """Narrowed, the logits are the batch's candidates alone (u columns) and greedy search,
    beam search and a target prefix run on them; the translations and scores are those of full
    vocabulary rows whose other columns are -inf."""
    model, tokenizer = tiny
    model = Ensemble([model, copy.deepcopy(model)]) if ensemble else model
    de, en = corpus[0], corpus[1]
    shortlist = build(tokenizer.source.encode(de), tokenizer.encode(en), len(tokenizer), len(tokenizer), first=10, best=3)  # fmt: skip
    shortlisted = ShortlistModel(model, shortlist, specials(tokenizer))
    src = pad([ids + [tokenizer.eos_id] for ids in tokenizer.source.encode(de[:12])], tokenizer.pad_id)
    prefix = torch.tensor([ids[:2] for ids in tokenizer.encode(en[:12])])
    narrow, full = shortlisted.for_batch(src, prefix, narrow=True), shortlisted.for_batch(src, prefix, narrow=False)
    assert narrow.columns is not None and full.columns is None
    assert len(narrow.columns) < len(tokenizer)
    for cfg, given in [(DecodeConfig(strategy="greedy"), None), (DecodeConfig(n_best=2), None), (DecodeConfig(), prefix)]:  # fmt: skip
        search = STRATEGIES[cfg.strategy].search
        cut, whole = (search(m, src, tokenizer.bos_id, tokenizer.eos_id, cfg, None, given) for m in (narrow, full))
        assert_same_translations(cut, whole)
        if given is not None:
            assert all(h.tokens[:2] == p for n, p in zip(cut, prefix.tolist()) for h in n)


def test_an_ensemble_decodes_within_each_sentences_candidates(tiny, corpus):
    """Each member's projection is cut to the same candidates; with a list that holds the
    ensemble's own greedy translations, they are unchanged."""
    model, tokenizer = tiny
    ensemble = Ensemble([model, copy.deepcopy(model)])
    sources, greedy = tokenizer.source.encode(corpus[0][:8]), DecodeConfig(strategy="greedy")
    full = [h[0].tokens for h in translate_ids(ensemble, sources, tokenizer, greedy, "cpu")]
    used = sorted({t for tokens in full for t in tokens})
    shortlist = Shortlist(torch.tensor(used), torch.full((len(tokenizer), 1), -1))
    shortlisted = ShortlistModel(ensemble, shortlist, specials(tokenizer))
    assert [h[0].tokens for h in translate_ids(shortlisted, sources, tokenizer, greedy, "cpu")] == full
    narrow = ShortlistModel(ensemble, Shortlist(torch.tensor(used[::2]), shortlist.table), specials(tokenizer))
    for hyps in translate_ids(narrow, sources, tokenizer, DecodeConfig(), "cpu"):
        assert set(hyps[0].tokens) <= set(used[::2]) | set(specials(tokenizer))


def test_an_output_layer_without_weights_is_refused_with_a_reason(corpus):
    """An int8 untied output layer keeps its weights packed for oneDNN, so no rows can be cut."""
    model, tokenizer = trained_model(corpus, {"tie_output": False}, steps=1)
    model.output = torch.nn.Identity()  # as Int8Linear, it has no `weight`
    empty = Shortlist(torch.tensor([5]), torch.full((len(tokenizer), 1), -1))
    with pytest.raises(ConfigError, match="an int8 untied output layer has none"):
        ShortlistModel(model, empty, specials(tokenizer))


def test_prefixes_and_constraints_reach_beyond_the_shortlist(tiny, corpus):
    model, tokenizer = tiny
    sources = tokenizer.source.encode(corpus[0][:4])
    empty = ShortlistModel(model, Shortlist(torch.tensor([], dtype=torch.long), torch.full((len(tokenizer), 1), -1)), specials(tokenizer))  # fmt: skip
    prefixes = [ids[:2] for ids in tokenizer.encode(corpus[1][:4])]
    out = translate_ids(empty, sources, tokenizer, DecodeConfig(), "cpu", prefixes=prefixes)
    assert [h[0].tokens[:2] for h in out] == prefixes
    phrase = [[ids[-2:]] for ids in tokenizer.encode(corpus[1][:4])]
    out = translate_ids(empty, sources, tokenizer, DecodeConfig(), "cpu", constraints=phrase)
    for hyps, (wanted,) in zip(out, phrase):
        tokens = hyps[0].tokens
        assert any(tokens[i : i + len(wanted)] == wanted for i in range(len(tokens)))


@pytest.mark.e2e
def test_commands_build_use_and_export_the_shortlist(trained, tmp_path, capsys, caplog, monkeypatch):  # noqa: F811
    """build_shortlist.py writes shortlist.tsv beside the checkpoint from the run's training split;
    translate.py decodes with it (and, under scheduler=continuous, in batches, saying why); the
    export carries it as CTranslate2's vmap.txt."""
    checkpoint = trained / "checkpoint_best.pt"
    assert run_main("scripts/build_shortlist.py", [f"checkpoint={checkpoint}", "first=30", "best=5"], b"", monkeypatch) == 0  # fmt: skip
    assert "shortlist of 400 pairs (train.de.gz/train.en.gz)" in capsys.readouterr().out
    lines = (trained / "shortlist.tsv").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("\t") and len(lines[0].split()) == 30 and len(lines) > 50
    source = b"Ein Hund rennt.\nZwei Frauen sitzen auf einer Bank.\n"
    for scheduler in ("batch", "continuous"):
        argv = [f"checkpoint={checkpoint}", "decode.shortlist=true", f"scheduler={scheduler}", f"output={tmp_path}/{scheduler}.en"]  # fmt: skip
        assert run_main("translate.py", argv, source, monkeypatch) == 0
        assert len((tmp_path / f"{scheduler}.en").read_text().splitlines()) == 2
    assert "decode.shortlist=true narrows the output layer per batch" in caplog.text
    assert run_main("evaluate.py", [f"checkpoint={checkpoint}", "decode.shortlist=true"], b"", monkeypatch) == 0
    assert "beam5-shortlist" in capsys.readouterr().out  # its own file: the full vocabulary's is not overwritten
    assert (trained / "checkpoint_best.test_2016_flickr.beam5-shortlist.hyp").is_file()
    pytest.importorskip("ctranslate2")
    assert run_main("scripts/export_ctranslate2.py", [f"checkpoint={checkpoint}", f"output={tmp_path}/ct2"], b"", monkeypatch) == 0  # fmt: skip
    assert (tmp_path / "ct2" / "vmap.txt").read_bytes() == (trained / "shortlist.tsv").read_bytes()
    assert "use_vmap=True" in capsys.readouterr().out


@pytest.mark.e2e
@pytest.mark.isa  # CTranslate2 picks its kernels by CPU too
def test_ctranslate2_with_the_vocabulary_map_decodes_as_our_shortlist(tiny, corpus, tmp_path):
    """Greedy search, one sentence a batch (both take the union of a batch's candidates): the same
    tokens from CTranslate2 with use_vmap=True as from our shortlisted model, unless they part at
    a tie of fp32 rounding (test_export.py's property, within the candidates)."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transformer.interop.export import export
    from transformer.interop.export import translate_ids as ctranslate2_ids

    from .test_export import greedy_tie

    model, tokenizer = tiny
    de, en = corpus[0], corpus[1]
    shortlist = build(tokenizer.source.encode(de), tokenizer.encode(en), len(tokenizer), len(tokenizer), first=20, best=6)  # fmt: skip
    path = tmp_path / "shortlist.tsv"
    shortlist.save(path, tokenizer.source.id_to_piece, tokenizer.id_to_piece)
    export(model, tokenizer, tmp_path / "ct2", "float32", shortlist=path)
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", compute_type="float32")
    cfg = DecodeConfig(strategy="greedy", shortlist=True)
    ours_model = ShortlistModel(model, shortlist, specials(tokenizer))
    full_vocabulary = 0
    for source in tokenizer.source.encode(de[:24]):
        ours = translate_ids(ours_model, [source], tokenizer, cfg, "cpu")[0][0].tokens
        theirs = ctranslate2_ids(translator, tokenizer, [source], cfg, model.cfg.max_positions)[0]
        assert ours == theirs or greedy_tie(model, tokenizer, source, ours, theirs, cfg), (ours, theirs)
        plain = translate_ids(model, [source], tokenizer, DecodeConfig(strategy="greedy"), "cpu")[0][0].tokens
        full_vocabulary += plain != ours
    assert full_vocabulary > 0  # the shortlist changed some translations: the map was in use on both sides
