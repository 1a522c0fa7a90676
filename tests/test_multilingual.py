"""Many-to-many models (data.directions): target tags in the vocabulary and at the start of every
source, temperature sampling, validation and tests per direction, and every consumer taking the
target language: translate.py (tgt_lang=, pivot=), evaluate.py (all_directions=), serve.py
(target_lang) and the CTranslate2 export; fine-tuning, ensembles and averaging refuse what does
not fit. The model is a smoke run on a small four-language slice of Multi30k, trained here."""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from transformer import checkpoint
from transformer.data import DataConfig, load_split
from transformer.data.batching import collate, tokenize
from transformer.data.sampling import direction_sizes, language_text, resample
from transformer.data.tokenizer import Tokenizer
from transformer.decoding import DecodeConfig
from transformer.errors import CheckpointError, ConfigError
from transformer.translator import Translator

from . import forked
from .conftest import DATA, write_corpus
from .servers import QUICK, Server, build_checkpoint, translate_py

DIRECTIONS = ["de-en", "en-de", "fr-en", "en-fr", "cs-en"]  # de-fr, fr-de, cs-de, ... are left out: zero-shot
SHORT = ["decode.max_len_b=5", "decode.max_len_a=0.5"]


def multi30k(split: str, lang: str, n: int) -> list[str]:
    with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [next(f).strip() for _ in range(n)]


def run(*args: str) -> subprocess.CompletedProcess:
    """`python *args`, its own process forked from a warm interpreter (tests/forked.py)."""
    return forked.run(list(args), timeout=600)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Multi30k's four languages, 300 training lines each; test_2017_flickr without cs, as shipped."""
    directory = tmp_path_factory.mktemp("multi") / "corpus"
    for split, n, langs in (("train", 300, "en de fr cs"), ("val", 20, "en de fr cs"), ("test_2016_flickr", 20, "en de fr cs"), ("test_2017_flickr", 20, "en de fr")):  # fmt: skip
        write_corpus(directory, split, {lang: multi30k(split, lang, n) for lang in langs.split()})
    return directory


def train(run_dir: Path, corpus: Path, *overrides: str) -> subprocess.CompletedProcess:
    """A smoke run without attention images, which took most of each validation and no test here reads."""
    return run("train.py", "experiment=smoke", f"hydra.run.dir={run_dir}", f"data.dir={corpus}", "data.vocab_size=400",
               "data.test_splits=[test_2016_flickr,test_2017_flickr]", "trainer.attention_images=false", *overrides)  # fmt: skip


@pytest.fixture(scope="module")
def many(tmp_path_factory, corpus) -> Path:
    """The run directory of a many-to-many smoke run over DIRECTIONS."""
    run_dir = tmp_path_factory.mktemp("multi") / "run"
    result = train(run_dir, corpus, f"data.directions=[{','.join(DIRECTIONS)}]")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


# --- Config and data -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"directions": ["de"]}, "'de' is not a direction like de-en"),
        ({"directions": ["de-de"]}, "'de-de' is not a direction"),
        ({"directions": ["de-en", "de-en"]}, "'de-en' is listed twice"),
        ({"directions": ["de-en"], "extra_src_langs": ["fr"]}, "use data.directions"),
        ({"directions": ["de-en"], "joint_vocab": False}, "needs one joint vocabulary"),
        ({"temperature": 0.0}, "data.temperature=0.0 must be > 0"),
    ],
)
def test_bad_directions_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**options)


def test_temperature_raises_small_directions_and_keeps_the_total():
    counts = {"de-en": 9000, "cs-en": 1000}
    assert direction_sizes(counts, 1.0) == counts
    flat = direction_sizes(counts, 5.0)
    assert sum(flat.values()) == 10000 and 1000 < flat["cs-en"] < flat["de-en"] < 9000
    assert abs(direction_sizes(counts, 1000.0)["cs-en"] - 5000) < 10  # a high temperature: nearly equal shares


def test_resampling_repeats_a_small_direction_whole_and_draws_the_rest():
    import datasets

    rows = {"src": [f"s{i}" for i in range(44)], "tgt": [f"t{i}" for i in range(44)]}
    rows |= {"src_lang": ["de"] * 40 + ["fr"] * 4, "tgt_lang": ["en"] * 44}
    ds = datasets.Dataset.from_dict(rows)
    out = resample(ds, 5.0, seed=1)
    sizes = direction_sizes({"de-en": 40, "fr-en": 4}, 5.0)
    fr = [s for s, lang in zip(out["src"], out["src_lang"]) if lang == "fr"]
    assert len(fr) == sizes["fr-en"] and len(out) == sum(sizes.values())
    assert all(fr.count(f"s{i}") >= sizes["fr-en"] // 4 for i in range(40, 44))  # every pair, whole copies first
    assert resample(ds, 5.0, seed=1)["src"] == out["src"]  # the same draw for the same seed


def test_the_tokenizer_text_holds_each_language_once(corpus):
    """en is the target of three directions and the source of two: its sentences count once."""
    ds = load_split(DataConfig(dir=str(corpus), directions=DIRECTIONS), "train")
    text = language_text(ds, 1.0, seed=1)
    assert sorted(text) == sorted(sum((multi30k("train", lang, 300) for lang in ("en", "de", "fr", "cs")), []))


def test_hub_datasets_give_each_direction(monkeypatch):
    """data.hub_name with data.directions (no network: load_dataset is replaced by a local dataset)."""
    import datasets

    rows = [{"en": "A dog.", "fr": "Un chien.", "de": "Ein Hund."}, {"en": "Two.", "fr": "Deux.", "de": "Zwei."}]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_dict({"translation": rows}))
    ds = load_split(DataConfig(hub_name="x/y", directions=["en-de", "de-fr"]), "train")
    assert ds["src"][:] == ["A dog.", "Two.", "Ein Hund.", "Zwei."] and ds["tgt"][:] == ["Ein Hund.", "Zwei.", "Un chien.", "Deux."]  # fmt: skip
    assert ds["src_lang"][:] == ["en", "en", "de", "de"] and ds["tgt_lang"][:] == ["de", "de", "fr", "fr"]


def test_a_tagged_tokenizer_tags_every_source_in_memory_and_streamed():
    """A many-to-many checkpoint's tokenizer fine-tuned on one direction (its tgt_lang), with the
    split in memory or in memory-mapped Arrow files (data.streaming): every source gets the tag."""
    import datasets

    from transformer.data.batching import tokenize_mapped

    de, en = multi30k("train", "de", 200), multi30k("train", "en", 200)
    tokenizer = Tokenizer.train(de + en, 200, "unigram", symbols=["<2en>", "<2de>"])
    ds = datasets.Dataset.from_dict({"src": de[:20], "tgt": en[:20]})
    plain = tokenizer.encode(de[:20])
    for corpus in (tokenize(ds, tokenizer, "en"), tokenize_mapped(ds, tokenizer, "en")):
        sources, _ = corpus.pairs(range(20))
        assert sources == [[tokenizer.target_tags["en"], *ids] for ids in plain]


# --- A many-to-many run ----------------------------------------------------------------------------


@pytest.mark.e2e
def test_every_source_starts_with_its_targets_tag_in_every_direction(many, corpus):
    tokenizer = Tokenizer.load(many / "spm.model")
    tags = tokenizer.target_tags
    assert sorted(tags) == ["de", "en", "fr"]  # a tag per target language, none for cs (only a source)
    assert all(tokenizer.id_to_piece(i) == f"<2{lang}>" for lang, i in tags.items())
    ds = load_split(DataConfig(dir=str(corpus), directions=DIRECTIONS), "train")
    data = tokenize(ds, tokenizer)
    assert sorted(data.directions()) == sorted(DIRECTIONS)
    for name, rows in data.directions().items():
        target = name.split("-")[1]
        for i in rows[:50]:
            assert data.src[i] == [tags[target], *tokenizer.encode([data.src_text[i]])[0]]
            assert data.tgt[i] == tokenizer.encode([data.tgt_text[i]])[0]  # targets carry no tag
        batch = collate(data, rows[:8], tokenizer)
        assert (batch.src[:, 0] == tags[target]).all()


@pytest.mark.e2e
def test_validation_and_tests_report_each_direction_and_their_mean(many):
    log = (many / "train.log").read_text()
    assert "training pairs in 5 directions" in log
    assert "(mean of de-en " in log and "cs-en" in log.split("(mean of")[1].split("\n")[0]
    metrics = [json.loads(line) for line in (many / "metrics.jsonl").read_text().splitlines()]
    valid = [m for m in metrics if "valid_bleu" in m][-1]
    per_direction = [valid[f"valid_bleu_{name}"] for name in DIRECTIONS]
    assert valid["valid_bleu"] == pytest.approx(sum(per_direction) / len(DIRECTIONS))
    results = json.loads((many / "results.json").read_text())["test"]
    for name in DIRECTIONS:
        assert f"test_2016_flickr/{name}/greedy" in results
        assert (many / f"test_2016_flickr.greedy.{name}").is_file()
    assert "test_2017_flickr/cs-en/greedy" not in results and "test_2017_flickr/fr-en/greedy" in results
    assert results["test_2017_flickr/mean/greedy"]["directions"] == 4


@pytest.mark.e2e
def test_translate_takes_the_target_language_and_a_pivot(many, tmp_path):
    path = many / "checkpoint_best.pt"
    sources = multi30k("val", "de", 6)
    text = "".join(s + "\n" for s in sources)
    missing = translate_py(f"checkpoint={path}", *SHORT, stdin=text)
    assert missing.returncode == 2 and "translates into de, en, fr: choose one with tgt_lang=" in missing.stderr
    wrong = translate_py(f"checkpoint={path}", "tgt_lang=cs", *SHORT, stdin=text)
    assert wrong.returncode == 2 and "tgt_lang=cs: this model translates into de, en, fr" in wrong.stderr
    translator = Translator.load(path, device="cpu", decode=DecodeConfig(max_len_b=5, max_len_a=0.5))
    tags = translator.tokenizer.target_tags
    for lang in ("fr", "en"):
        result = translate_py(f"checkpoint={path}", f"tgt_lang={lang}", *SHORT, stdin=text)
        assert result.returncode == 0, result.stderr[-2000:]
        tagged = [[tags[lang], *ids] for ids in translator.tokenizer.encode(sources)]
        expected = translator.texts([hyps[0] for hyps in translator.translate_ids(tagged)])
        assert result.stdout.splitlines() == expected
    pivoted = translate_py(f"checkpoint={path}", "tgt_lang=fr", "pivot=en", *SHORT, stdin=text)
    assert pivoted.returncode == 0, pivoted.stderr[-2000:]
    english = translator.translate(sources, tgt_lang="en")
    assert pivoted.stdout.splitlines() == translator.translate(english, tgt_lang="fr")


@pytest.mark.e2e
def test_evaluate_scores_every_direction_trained_and_zero_shot(many, corpus):
    result = run("evaluate.py", f"checkpoint={many / 'checkpoint_best.pt'}", "all_directions=true", "decode=greedy", *SHORT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split("|")[1:4] for line in result.stdout.splitlines() if line.startswith("| ")]
    kinds = {name.strip(): trained.strip() for name, trained, _ in rows}
    assert kinds["de-en"] == "yes" and kinds["de-fr"] == "zero-shot" and kinds["cs-fr"] == "zero-shot"
    assert "cs-en" in kinds and "en-cs" not in kinds  # cs is never a target: it has no tag
    assert "mean of 5" in kinds and "mean of 4" in kinds  # 5 trained, 4 zero-shot into de, en, fr
    one = run("evaluate.py", f"checkpoint={many / 'checkpoint_best.pt'}", "src_lang=fr", "tgt_lang=de", "decode=greedy", *SHORT)  # fmt: skip
    assert one.returncode == 0 and "test_2016_flickr.fr.gz -> test_2016_flickr.de.gz" in one.stdout
    assert (many / "checkpoint_best.test_2016_flickr.greedy.fr-de.hyp").is_file()  # one file per direction


@pytest.mark.e2e
def test_evaluate_all_directions_refuses_the_options_of_one_direction(tmp_path):
    """all_directions=true reads split= in every language and names its own outputs: src=, ref=,
    src_lang=, tgt_lang=, output= and compare= would be ignored, so each stops it before anything
    is translated or written."""
    path = build_checkpoint(tmp_path / "many.pt", directions=("de-en", "en-de"))
    corpus = tmp_path / "corpus"
    write_corpus(corpus, "val", {lang: multi30k("val", lang, 3) for lang in ("de", "en")})
    (tmp_path / "base.en").write_text("".join(s + "\n" for s in multi30k("val", "en", 3)))
    before = sorted(tmp_path.rglob("*"))
    scoring = [f"checkpoint={path}", "all_directions=true", "split=val", f"data_dir={corpus}", "decode=greedy", *SHORT]
    for given in (f"compare={tmp_path / 'base.en'}", f"output={tmp_path / 'out.hyp'}", f"src={corpus / 'val.de.gz'}",
                  f"ref={corpus / 'val.en.gz'}", "src_lang=de", "tgt_lang=en"):  # fmt: skip
        result = run("evaluate.py", *scoring, given)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert len(errors) == 1 and errors[0].endswith(f"it cannot be used with {given.split('=')[0]}=")
    assert sorted(tmp_path.rglob("*")) == before  # no hypotheses written


@pytest.mark.e2e
def test_the_server_translates_into_the_requested_language(many):
    path = many / "checkpoint_best.pt"
    sources = multi30k("val", "de", 3)
    with Server(f"checkpoint={path}", *QUICK) as server:
        health = httpx.get(server.url + "/health", timeout=60).json()
        assert health["target_languages"] == ["de", "en", "fr"] and health["language_pair"] is None
        answer = httpx.post(server.url + "/v1/translate", json={"text": sources, "target_lang": "fr"}, timeout=60)
        assert answer.status_code == 200, answer.text
        expected = translate_py(f"checkpoint={path}", "tgt_lang=fr", *QUICK, stdin="".join(s + "\n" for s in sources))
        assert answer.json()["translations"] == expected.stdout.splitlines()
        for body, message in (({"text": sources}, "choose one with target_lang="), ({"text": sources, "target_lang": "cs"}, "target_lang=cs"), ({"text": sources, "target_lang": 3}, "must be a language code")):  # fmt: skip
            refused = httpx.post(server.url + "/v1/translate", json=body, timeout=60)
            assert refused.status_code == 422 and message in refused.json()["error"]
        aligned = httpx.post(server.url + "/v1/align", json={"text": sources[0], "target_lang": "en"}, timeout=60)
        assert aligned.status_code == 200 and aligned.json()["source_tokens"][0] == "<2en>"


@pytest.mark.e2e
def test_the_ctranslate2_export_takes_the_tag_as_a_source_token(many, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transformer.interop.export import export
    from transformer.interop.export import translate_ids as ctranslate2_ids

    model, tokenizer, _ = checkpoint.load_model(many / "checkpoint_best.pt")
    export(model, tokenizer, tmp_path / "ct2", "float32")
    engine = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", compute_type="float32")
    translator = Translator.load(many / "checkpoint_best.pt", device="cpu", decode=DecodeConfig(strategy="greedy", max_len_b=5, max_len_a=0.5))  # fmt: skip
    sources = multi30k("val", "de", 12)
    for lang in ("fr", "en"):
        ids = translator.encode(sources, lang)
        assert all(row[0] == tokenizer.target_tags[lang] for row in ids)
        ours = [hyps[0].tokens for hyps in translator.translate_ids(ids)]
        assert ctranslate2_ids(engine, tokenizer, ids, translator.decode, model.cfg.max_positions) == ours


@pytest.mark.e2e
def test_fine_tuning_ensembles_and_averaging_check_the_tags(many, corpus, tmp_path):
    path = many / "checkpoint_best.pt"
    # A many-to-many checkpoint fine-tuned on one direction keeps tagging its sources.
    one_way = train(tmp_path / "one", corpus, f"init_from={path}", "data.src_lang=fr", "data.tgt_lang=de", "trainer.max_steps=4", "trainer.eval_every=4")  # fmt: skip
    assert one_way.returncode == 0, one_way.stderr[-3000:]
    finetuned = Translator.load(tmp_path / "one" / "checkpoint_best.pt", device="cpu")
    assert finetuned.encode(["Un chien."])[0][0] == finetuned.tokenizer.target_tags["de"]  # its default target
    # A bilingual checkpoint has no tags to start a many-to-many run from.
    bilingual = build_checkpoint(tmp_path / "bilingual.pt")
    refused = train(tmp_path / "refused", corpus, f"init_from={bilingual}", f"data.directions=[{','.join(DIRECTIONS)}]")
    assert refused.returncode == 2 and "the tokenizer has no target tag for de, en, fr" in refused.stderr
    with pytest.raises(ConfigError, match="target-language tags none, but .* has de, en, fr"):
        Translator.load(path, [str(bilingual)], device="cpu")
    untagged = checkpoint.load(path) | {"tokenizer": checkpoint.load(bilingual)["tokenizer"]}
    checkpoint.write(tmp_path / "untagged.pt", untagged)
    with pytest.raises(CheckpointError, match="has target-language tags none, but .* has de, en, fr"):
        checkpoint.average([tmp_path / "untagged.pt", path])
    assert torch.equal(checkpoint.average([path, path])["model"]["embed.embed.weight"], checkpoint.load(path)["model"]["embed.embed.weight"])  # fmt: skip
