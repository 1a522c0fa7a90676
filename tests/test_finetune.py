"""Fine-tuning with init_from=PATH: a trained smoke model continues on another corpus with its
weights, architecture and tokenizer, under the new run's data, optimizer and schedule; overrides
that would change its architecture or vocabulary are refused; a killed fine-tuning run resumes to
exactly the uninterrupted one (the crash helpers of test_crash_recovery.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from transformer import checkpoint
from transformer.data import DataConfig, load_split
from transformer.data.batching import tokenize
from transformer.training.validation import validation_loss

from .conftest import DATA, write_corpus
from .test_crash_recovery import assert_same, outcome, train

pytestmark = pytest.mark.e2e  # every test runs train.py


def multi30k_slice(split: str, start: int, n: int) -> dict[str, list[str]]:
    pairs = {}
    for lang in ("de", "en"):
        with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
            pairs[lang] = [line.strip() for i, line in enumerate(f) if start <= i < start + n]
    return pairs


@pytest.fixture(scope="module")
def other_corpus(tmp_path_factory) -> Path:
    """Pairs the base model never saw: later lines of Multi30k's train and val splits."""
    directory = tmp_path_factory.mktemp("other") / "corpus"
    write_corpus(directory, "train", multi30k_slice("train", 5000, 400))
    write_corpus(directory, "val", multi30k_slice("val", 500, 40))
    return directory


@pytest.fixture(scope="module")
def base(tmp_path_factory, shared_corpus) -> Path:
    """A smoke model trained on the shared slice: its checkpoint_last.pt (optimizer state included)."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    result = train(run_dir, shared_corpus)
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, base, other_corpus) -> Path:
    run_dir = tmp_path_factory.mktemp("finetuned") / "run"
    result = train(run_dir, other_corpus, f"init_from={base}", "model.dropout=0.2")
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def valid_loss(path: Path, corpus: Path) -> float:
    model, tokenizer, _ = checkpoint.load_model(path)
    data = tokenize(load_split(DataConfig(dir=str(corpus)), "val"), tokenizer)
    return validation_loss(model, data, tokenizer, 4096, torch.device("cpu"), None)


def test_finetuning_lowers_the_new_corpus_loss_and_keeps_the_tokenizer(base, finetuned, other_corpus):
    before, after = valid_loss(base, other_corpus), valid_loss(finetuned / "checkpoint_best.pt", other_corpus)
    assert after < before
    saved, tuned = checkpoint.load(base), checkpoint.load(finetuned / "checkpoint_last.pt")
    assert torch.equal(tuned["tokenizer"], saved["tokenizer"])  # byte for byte
    assert (finetuned / "spm.model").read_bytes() == checkpoint.as_bytes(saved["tokenizer"])
    assert tuned["model_config"] == saved["model_config"] | {"dropout": 0.2}  # regularization from the new run
    assert tuned["step"] == 12  # step, optimizer and schedule start afresh: the same budget as the base run
    origin = json.loads((finetuned / "init_from.json").read_text())
    assert origin["path"] == str(base.resolve()) and origin["step"] == saved["step"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.d_model=48", "model.d_model"),
        ("model=small", "model.n_encoder_layers"),
        ("data.vocab_size=500", "data.vocab_size"),
    ],  # fmt: skip
)
def test_an_override_that_changes_the_architecture_or_vocabulary_is_refused(base, other_corpus, tmp_path, override, key):  # fmt: skip
    result = train(tmp_path / "run", other_corpus, f"init_from={base}", override)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], result.stderr
    assert not (tmp_path / "run" / "checkpoint_last.pt").exists()


def test_a_killed_finetuning_run_resumes_to_the_uninterrupted_one(base, finetuned, other_corpus, tmp_path):
    run_dir, args = tmp_path / "run", (f"init_from={base}", "model.dropout=0.2")
    killed = train(run_dir, other_corpus, *args, crash=("checkpoint_last.pt", 6, "during"))
    assert killed.returncode == 137, killed.stderr[-2000:]
    resumed = train(run_dir, other_corpus, *args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed at step" in resumed.stdout
    assert_same(outcome(run_dir), outcome(finetuned))


def test_frozen_parts_keep_their_weights(base, other_corpus, tmp_path):
    run_dir = tmp_path / "run"
    result = train(run_dir, other_corpus, f"init_from={base}", "trainer.freeze=[embeddings,encoder]")
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = checkpoint.load(base)["model"], checkpoint.load(run_dir / "checkpoint_last.pt")["model"]
    for name, weights in before.items():
        frozen = name.startswith(("embed.", "encoder_layers.", "encoder_norm."))
        assert torch.equal(after[name], weights) == frozen, name
