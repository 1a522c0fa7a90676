"""Reading corpora, the errors bad input gets, and token-count batching."""

import numpy as np
import pytest

from transformer.data import DataConfig, DataError, clean_training_pairs, load_split, read_lines
from transformer.data.batching import token_batches

from .conftest import write_corpus

pytestmark = pytest.mark.isa_free  # no kernel an instruction-set limit changes: `make test-avx2` leaves it out


def test_reads_gzip_and_plain_files_stripping_whitespace(tmp_path):
    write_corpus(tmp_path, "train", {"de": ["  Ein Hund. ", "Zwei\u00a0"]}, gz=True)
    write_corpus(tmp_path, "train", {"en": ["A dog.", " Two"]}, gz=False)
    ds = load_split(DataConfig(dir=str(tmp_path)), "train")
    assert ds["src"][:] == ["Ein Hund.", "Zwei"] and ds["tgt"][:] == ["A dog.", "Two"]


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
    write_corpus(tmp_path, "train", {"de": ["a", "b", "c"], "en": ["a", "b"]})
    with pytest.raises(DataError, match=r"train\.de\.gz has 3 lines, .*train\.en\.gz has 2"):
        load_split(DataConfig(dir=str(tmp_path)), "train")


def test_unknown_language_lists_the_available_ones(tmp_path):
    write_corpus(tmp_path, "train", {"de": ["a"], "en": ["a"]})
    with pytest.raises(DataError, match=r"unknown language code 'xx'.*available: de, en"):
        load_split(DataConfig(dir=str(tmp_path), src_lang="xx"), "train")


def test_missing_split_and_missing_directory(tmp_path):
    write_corpus(tmp_path, "train", {"de": ["a"], "en": ["a"]})
    with pytest.raises(DataError, match=r"missing data file .*val\.de"):
        load_split(DataConfig(dir=str(tmp_path)), "val")
    with pytest.raises(DataError, match=r"nowhere does not exist"):
        load_split(DataConfig(dir=str(tmp_path / "nowhere")), "train")


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "train.de"
    path.write_bytes(b"fine\nalso fine\nbad \xff byte\n")
    with pytest.raises(DataError, match=r"train\.de:3: line is not valid UTF-8"):
        read_lines(path)


def test_empty_pairs_are_dropped_and_an_empty_training_set_is_refused(tmp_path):
    write_corpus(tmp_path, "train", {"de": ["a", "", "c"], "en": ["a", "b", ""]})
    kept = clean_training_pairs(load_split(DataConfig(dir=str(tmp_path)), "train"), "train")
    assert kept["src"][:] == ["a"]
    write_corpus(tmp_path, "train", {"de": ["", ""], "en": ["x", ""]})
    with pytest.raises(DataError, match="no non-empty sentence pairs"):
        clean_training_pairs(load_split(DataConfig(dir=str(tmp_path)), "train"), "train")


def test_token_batches_cover_every_sentence_once_within_the_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=1000)
    batches = token_batches(lengths, max_tokens=512, rng=np.random.default_rng(1))
    seen = np.concatenate(batches)
    assert sorted(seen.tolist()) == list(range(1000))
    assert all(len(b) * lengths[b].max() <= 512 for b in batches)
    # Similar lengths are grouped: padding is a small fraction of the padded tokens.
    padded = sum(len(b) * lengths[b].max() for b in batches)
    assert lengths.sum() / padded > 0.9


def test_token_batches_are_a_function_of_the_seed():
    lengths = np.random.default_rng(0).integers(1, 30, size=300)
    first = token_batches(lengths, 256, np.random.default_rng([1, 1]))
    again = token_batches(lengths, 256, np.random.default_rng([1, 1]))
    other = token_batches(lengths, 256, np.random.default_rng([1, 2]))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def generated_corpus(directory, n: int, seed: int = 0) -> None:
    """n random sentence pairs of varied length over a small vocabulary (the 'translation' of
    each word is the word in upper case), with a few empty and whitespace-only lines."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(300)]
    src, tgt = [], []
    for _ in range(n):
        sentence = list(rng.choice(words, size=int(rng.integers(1, 40))))
        src.append(" ".join(sentence))
        tgt.append(" ".join(w.upper() for w in reversed(sentence)))
    src[7], tgt[11] = "", "   "
    write_corpus(directory, "train", {"de": src, "en": tgt})


def test_streaming_gives_the_same_batches_as_in_memory_reading(tmp_path, monkeypatch):
    """data.streaming=true reads a generated corpus through memory-mapped Arrow files; the pairs
    kept, their lengths and every batch equal those of in-memory reading."""
    from transformer.data import training_text
    from transformer.data.batching import MappedCorpus, collate, filter_long, tokenize, tokenize_mapped
    from transformer.data.tokenizer import Tokenizer

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    generated_corpus(tmp_path / "gen", 3000)
    in_memory = clean_training_pairs(load_split(DataConfig(dir=str(tmp_path / "gen")), "train"), "train")
    mapped = clean_training_pairs(load_split(DataConfig(dir=str(tmp_path / "gen"), streaming=True), "train"), "train")
    assert len(in_memory) == len(mapped) == 2998
    assert mapped.cache_files, "the streamed split must live in Arrow files, not in memory"

    tokenizer = Tokenizer.train(training_text(mapped), vocab_size=250, model_type="unigram", sample=2000)
    a, b = filter_long(tokenize(in_memory, tokenizer), 30), filter_long(tokenize_mapped(mapped, tokenizer), 30)
    assert isinstance(b, MappedCorpus) and len(a) == len(b) < 2998
    np.testing.assert_array_equal(a.lengths(), b.lengths())
    for indices in token_batches(a.lengths(), 512, np.random.default_rng(0))[:20]:
        x, y = collate(a, indices, tokenizer), collate(b, indices, tokenizer)
        assert x.src.equal(y.src) and x.tgt_out.equal(y.tgt_out) and x.n_tgt_tokens == y.n_tgt_tokens


def test_streaming_reports_the_line_that_is_not_utf8(tmp_path, monkeypatch):
    import gzip

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    write_corpus(tmp_path, "train", {"en": ["a", "b", "c"]})
    (tmp_path / "train.de.gz").write_bytes(gzip.compress(b"a\nb\n\xff\xfe\n"))
    with pytest.raises(DataError, match=r"train\.de\.gz:3: line is not valid UTF-8"):
        load_split(DataConfig(dir=str(tmp_path), streaming=True), "train")


def test_subword_sampling_redraws_each_epoch_and_keeps_the_text(tmp_path, shared_corpus):
    """data.subword_alpha: each epoch sees another segmentation of the same sentences, a function
    of (seed, epoch); every sampled sequence still spells its sentence and fits data.max_len."""
    from transformer.config import Config
    from transformer.data.batching import filter_long, tokenize
    from transformer.data.tokenizer import Tokenizer
    from transformer.model import ModelConfig, Transformer
    from transformer.training import Trainer

    cfg = Config(data=DataConfig(dir=str(shared_corpus), subword_alpha=0.3, max_len=40))
    ds = load_split(cfg.data, "train")
    tokenizer = Tokenizer.train(list(ds["src"]) + list(ds["tgt"]), vocab_size=300, model_type="unigram")
    corpus = filter_long(tokenize(ds, tokenizer), cfg.data.max_len)
    model = Transformer(ModelConfig(vocab_size=len(tokenizer), n_encoder_layers=1, n_decoder_layers=1, d_model=32, n_heads=2, d_ff=64))  # fmt: skip
    trainer = Trainer(cfg, tmp_path, model, tokenizer, corpus, corpus)

    first, second = trainer.batches.epoch_corpus(1), trainer.batches.epoch_corpus(2)
    assert first.src != corpus.src and second.src != first.src and second.tgt != first.tgt
    assert sum(map(len, first.tgt)) > sum(map(len, corpus.tgt))  # sampled pieces are shorter on average
    for sampled in (first, second):
        assert tokenizer.decode(sampled.src) == tokenizer.decode(corpus.src)  # text as SentencePiece normalizes it
        assert tokenizer.decode(sampled.tgt) == tokenizer.decode(corpus.tgt)
        assert max(sampled.lengths()) <= 40
    assert Trainer(cfg, tmp_path, model, tokenizer, corpus, corpus).batches.epoch_corpus(2).src == second.src
    batches = trainer.batches.epoch_batches(2)  # batched by the sampled lengths
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(corpus)))
    assert all(len(b) * second.lengths()[b].max() <= cfg.data.max_tokens or len(b) == 1 for b in batches)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"subword_alpha": -0.1}, "data.subword_alpha=-0.1 must be >= 0"),
        ({"subword_alpha": 0.1, "spm_model_type": "bpe"}, "needs data.spm_model_type=unigram, not 'bpe'"),
        ({"subword_alpha": 0.1, "subword_nbest": 1}, "data.subword_nbest=1 must be at least 2"),
        ({"subword_alpha": 0.1, "streaming": True}, "cannot be used with data.streaming=true"),
    ],
)
def test_bad_subword_sampling_settings_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**options)


def test_subword_sampler_draws_segmentations_with_probability_p_to_the_alpha(shared_corpus):
    """Each of a sentence's n-best segmentations comes up with probability proportional to
    P(segmentation) ** alpha; the best one is the usual segmentation."""
    from transformer.data.batching import SubwordSampler, tokenize
    from transformer.data.tokenizer import Tokenizer

    ds = load_split(DataConfig(dir=str(shared_corpus)), "train")
    tokenizer = Tokenizer.train(list(ds["src"]) + list(ds["tgt"]), vocab_size=300, model_type="unigram")
    corpus = tokenize(ds.select(range(2)), tokenizer)
    alternatives = tokenizer.nbest([corpus.src_text[0]], 4)[0]
    assert alternatives[0] == corpus.src[0] and len(alternatives) == 4
    log_p = np.array([tokenizer.piece_scores()[a].sum() for a in alternatives])
    expected = np.exp(0.5 * (log_p - log_p.max()))
    expected /= expected.sum()

    sampler = SubwordSampler(corpus, tokenizer, DataConfig(subword_alpha=0.5, subword_nbest=4))
    rng = np.random.default_rng(0)
    draws = [sampler.draw(rng).src[0] for _ in range(4000)]
    observed = np.array([sum(d == a for d in draws) for a in alternatives]) / len(draws)
    np.testing.assert_allclose(observed, expected, atol=0.03)


def test_extra_source_languages_pair_with_the_same_targets_in_training_only(tmp_path, monkeypatch):
    """data.extra_src_langs (many-to-one): the training split holds the en -> de pairs and then
    the fr -> de pairs, tagged by source language, in memory and streamed alike; validation
    stays en -> de."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    lines = {"en": ["A dog.", "Two cats."], "fr": ["Un chien.", "Deux chats."], "de": ["Ein Hund.", "Zwei Katzen."]}
    write_corpus(tmp_path, "train", lines)
    write_corpus(tmp_path, "val", lines)
    cfg = DataConfig(dir=str(tmp_path), src_lang="en", tgt_lang="de", extra_src_langs=["fr"])
    for streaming in (False, True):
        cfg.streaming = streaming
        train = load_split(cfg, "train")
        assert train["src"][:] == lines["en"] + lines["fr"] and train["tgt"][:] == lines["de"] * 2
        assert train["src_lang"][:] == ["en", "en", "fr", "fr"]
    valid = load_split(cfg, "val")
    assert valid["src"][:] == lines["en"] and "src_lang" not in valid.column_names

    cfg.extra_src_langs = ["fr", "cs"]
    with pytest.raises(DataError, match=r"unknown language code 'cs'.*available: de, en, fr"):
        load_split(cfg, "train")


@pytest.mark.parametrize("extra", [["en"], ["de"], ["fr", "fr"]])
def test_an_extra_source_language_must_be_new(extra):
    with pytest.raises(ValueError, match=f"data.extra_src_langs: '{extra[0]}'"):
        DataConfig(src_lang="en", tgt_lang="de", extra_src_langs=extra)


@pytest.mark.parametrize("streaming", [False, True])
def test_the_tokenizer_sees_each_target_once_with_extra_source_languages(tmp_path, monkeypatch, streaming):
    """The targets repeat once per source language in the training split; the joint
    SentencePiece model must not weigh the target language by that count."""
    from types import SimpleNamespace

    from transformer.training import experiment

    lines = {"en": ["A dog.", "Two cats."], "fr": ["Un chien.", "Deux chats."], "de": ["Ein Hund.", "Zwei Katzen."]}
    write_corpus(tmp_path, "train", lines)
    seen = []
    monkeypatch.setattr(experiment.Tokenizer, "train", lambda text, *a: seen.append(list(text)) or 1 / 0)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    data = DataConfig(dir=str(tmp_path), src_lang="en", tgt_lang="de", extra_src_langs=["fr"], streaming=streaming)
    with pytest.raises(ZeroDivisionError):  # stop once the text is handed over
        experiment.train_tokenizer(SimpleNamespace(data=data), load_split(data, "train"))
    assert sorted(seen[0]) == sorted(lines["en"] + lines["fr"] + lines["de"])


def test_hub_splits_are_loaded_once_for_all_source_languages(monkeypatch):
    """data.hub_name (no network here: load_dataset is replaced by a local dataset): the
    "translation" column gives each source language's pairs from one load of the split."""
    import datasets

    loads = []
    rows = [{"en": "A dog.", "fr": "Un chien.", "de": "Ein Hund."}, {"en": "Two.", "fr": "Deux.", "de": "Zwei."}]

    def load_dataset(name, config, split):
        loads.append(split)
        return datasets.Dataset.from_dict({"translation": rows})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)  # data.py imports datasets when it loads a split
    cfg = DataConfig(hub_name="x/y", src_lang="en", tgt_lang="de", extra_src_langs=["fr"])
    train = load_split(cfg, "train")
    assert loads == ["train"]
    assert train["src"][:] == ["A dog.", "Two.", "Un chien.", "Deux."] and train["tgt"][:] == ["Ein Hund.", "Zwei."] * 2
    assert train["src_lang"][:] == ["en", "en", "fr", "fr"]
    assert load_split(cfg, "val")["src"][:] == ["A dog.", "Two."]

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_dict({"en": ["a"], "de": ["b"]}))  # fmt: skip
    with pytest.raises(DataError, match=r"unknown language code 'fr' for x/y"):
        load_split(cfg, "train")
