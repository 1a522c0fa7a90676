"""Checkpoints: a save -> load round trip gives identical outputs; bad files are refused clearly."""

import pickle

import pytest
import torch

from transformer import checkpoint
from transformer.checkpoint import CheckpointError
from transformer.model import ModelConfig, Transformer
from transformer.tokenizer import Tokenizer

SENTENCES = ["Ein Hund läuft im Park.", "A dog runs in the park.", "Zwei Männer spielen Fußball."] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(SENTENCES, vocab_size=36, model_type="unigram")


def test_round_trip_gives_identical_outputs(tmp_path, tokenizer):
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            vocab_size=len(tokenizer),
            n_encoder_layers=1,
            n_decoder_layers=2,
            d_model=16,
            n_heads=2,
            d_ff=32,
            n_kv_heads=1,
        )
    ).eval()
    path = tmp_path / "model.pt"
    checkpoint.save(path, model, tokenizer, train_config={"seed": 1}, step=7)
    loaded, loaded_tokenizer, payload = checkpoint.load_model(path)
    src, tgt = torch.randint(4, len(tokenizer), (2, 5)), torch.randint(4, len(tokenizer), (2, 4))
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, tgt), model(src, tgt), rtol=0, atol=0)
    assert loaded.cfg == model.cfg and payload["step"] == 7 and payload["train_config"] == {"seed": 1}
    assert loaded_tokenizer.encode(SENTENCES[:2]) == tokenizer.encode(SENTENCES[:2])
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed into place


class NotATensor:
    pass


def test_arbitrary_pickled_objects_are_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format_version": checkpoint.FORMAT_VERSION, "payload": NotATensor()}, path)
    with pytest.raises(CheckpointError, match="not a safe checkpoint"):
        checkpoint.load(path)


def test_truncated_foreign_and_missing_files_are_refused(tmp_path, tokenizer):
    model = Transformer(
        ModelConfig(vocab_size=len(tokenizer), n_encoder_layers=1, n_decoder_layers=1, d_model=16, n_heads=2, d_ff=32)
    )
    good = tmp_path / "good.pt"
    checkpoint.save(good, model, tokenizer, train_config={}, step=1)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    old = tmp_path / "old.pt"
    torch.save({"format_version": 0}, old)
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps([1, 2, 3]))
    for path, message in [
        (truncated, "not a readable checkpoint"),
        (text, "not a"),
        (old, "format version 0"),
        (plain, "not a"),
        (tmp_path / "missing.pt", "does not exist"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            checkpoint.load(path)
