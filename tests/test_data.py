"""Reading corpora, the errors bad input gets, and token-count batching."""

import numpy as np
import pytest

from transformer.data import DataConfig, DataError, clean_training_pairs, load_split, read_lines, token_batches

from .conftest import write_corpus


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
