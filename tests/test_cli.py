"""The entry points as a user runs them: an end-to-end smoke run, then bad input of every kind."""

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, write_corpus


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=600)


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run("train.py", "experiment=smoke", f"hydra.run.dir={run_dir}", *overrides)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0]


def test_smoke_run_trains_evaluates_and_translates(tmp_path, tiny_corpus):
    run_dir = tmp_path / "run"
    result = train(run_dir, f"data.dir={tiny_corpus}", "data.vocab_size=300")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "test_2016_flickr de-en (greedy): BLEU" in result.stdout
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in result.stdout  # the sacreBLEU signature
    for name in ("checkpoint_best.pt", "checkpoint_last.pt", "spm.model", "train.log", "test_2016_flickr.en.hyp"):
        assert (run_dir / name).is_file(), name
    hyps = (run_dir / "test_2016_flickr.en.hyp").read_text().splitlines()
    assert len(hyps) == 40

    # translate.py with the same decoding settings reproduces the test hypotheses from the checkpoint alone.
    source = (tiny_corpus / "test_2016_flickr.de.gz")
    import gzip

    sentences = gzip.decompress(source.read_bytes()).decode()
    translated = run("translate.py", f"checkpoint={run_dir / 'checkpoint_best.pt'}", "decode.max_len_b=5", stdin=sentences)
    assert translated.returncode == 0, translated.stderr
    assert translated.stdout.splitlines() == hyps


def test_unknown_config_key_fails_with_hydras_error(tmp_path):
    result = train(tmp_path / "run", "model.colour=blue")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "model.colour" in result.stderr


@pytest.mark.parametrize(
    "override, needles",
    [("trainer.lr=fast", ["trainer.lr"]), ("model.n_kv_heads=3", ["model.n_kv_heads"]), ("data.src_lang=xx", ["unknown language code 'xx'", "train.xx"])],
)
def test_bad_values_give_one_error_line(tmp_path, tiny_corpus, override, needles):
    assert_one_line_error(train(tmp_path / "run", f"data.dir={tiny_corpus}", override), *needles)


def test_missing_data_directory(tmp_path):
    missing = tmp_path / "nowhere"
    assert_one_line_error(train(tmp_path / "run", f"data.dir={missing}"), str(missing))


def test_line_count_mismatch(tmp_path, tiny_corpus):
    write_corpus(tiny_corpus, "train", {"de": ["eins", "zwei", "drei"], "en": ["one", "two"]})
    assert_one_line_error(train(tmp_path / "run", f"data.dir={tiny_corpus}"), "train.de.gz has 3 lines", "train.en.gz has 2")


def test_empty_training_set(tmp_path, tiny_corpus):
    write_corpus(tiny_corpus, "train", {"de": ["", ""], "en": ["", ""]})
    assert_one_line_error(train(tmp_path / "run", f"data.dir={tiny_corpus}"), "no non-empty sentence pairs")


def test_translate_refuses_a_file_that_is_not_a_checkpoint(tmp_path):
    bogus = tmp_path / "model.pt"
    bogus.write_text("hello\n")
    assert_one_line_error(run("translate.py", f"checkpoint={bogus}", stdin="Hallo\n"), str(bogus))
    assert_one_line_error(run("translate.py", "beam=5", stdin=""), "beam")
