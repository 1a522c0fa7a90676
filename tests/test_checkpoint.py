"""Checkpoints: a save -> load round trip gives identical outputs; bad files are refused clearly."""

import pickle

import pytest
import torch

from transformer import checkpoint
from transformer.checkpoint import CheckpointError
from transformer.data.tokenizer import Tokenizer
from transformer.model import ModelConfig, Transformer

from .conftest import RemovesAFile

SENTENCES = ["Ein Hund läuft im Park.", "A dog runs in the park.", "Zwei Männer spielen Fußball."] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(SENTENCES, vocab_size=36, model_type="unigram")


@pytest.mark.parametrize("options", [{}, {"positional": "rope", "tie_output": False}, {"positional": "learned", "output_bias": True}])  # fmt: skip
def test_round_trip_gives_identical_outputs(tmp_path, tokenizer, options):
    """The loaded model, built without drawing random weights (initialization_skipped), has every
    weight and buffer of the saved one, position tables included; torch.nn.init draws again after."""
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
            **options,
        )
    ).eval()
    path = tmp_path / "model.pt"
    checkpoint.save(path, model, tokenizer, train_config={"seed": 1}, step=7)
    loaded, loaded_tokenizer, payload = checkpoint.load_model(path)
    src, tgt = torch.randint(4, len(tokenizer), (2, 5)), torch.randint(4, len(tokenizer), (2, 4))
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, tgt), model(src, tgt), rtol=0, atol=0)
    for (name, theirs), (_, ours) in zip(model.named_buffers(), loaded.named_buffers(), strict=True):
        assert torch.equal(ours, theirs), name
    assert not torch.equal(torch.nn.init.normal_(torch.zeros(8)), torch.zeros(8))
    assert loaded.cfg == model.cfg and payload["step"] == 7 and payload["train_config"] == {"seed": 1}
    assert loaded_tokenizer.encode(SENTENCES[:2]) == tokenizer.encode(SENTENCES[:2])
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed into place


class NotATensor:
    pass


def test_arbitrary_pickled_objects_are_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format_version": checkpoint.FORMAT_VERSION, "payload": NotATensor()}, path)
    with pytest.raises(CheckpointError, match="refused as unsafe.*NotATensor"):
        checkpoint.load(path)


def test_a_checkpoint_that_runs_code_is_refused_without_advice_to_load_it_unsafely(tmp_path):
    """torch's message says re-running torch.load with weights_only=False "will likely succeed":
    for a file that asks to run code, that is the one thing not to do. The error names the file,
    says why it was refused, and the code did not run."""
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    path = tmp_path / "code.pt"
    torch.save({"format_version": checkpoint.FORMAT_VERSION, "payload": RemovesAFile(victim)}, path)
    text = tmp_path / "notes.pt"  # not a pickle at all: torch's message carries the same advice
    text.write_text("not a checkpoint\n")
    for bad, why in ((path, "was refused as unsafe: it asks to run code when loaded"), (text, "is not a")):
        with pytest.raises(CheckpointError) as refused:
            checkpoint.load(bad)
        message = str(refused.value)
        assert message.startswith(f"{bad} {why}") and "\n" not in message
        assert "weights_only" not in message and "will likely succeed" not in message
    assert victim.read_text() == "keep me\n"


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
