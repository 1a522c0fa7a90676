"""int8 decoding (decode.precision=int8): every linear layer becomes an Int8Linear (fast/int8.py),
whose rows do not depend on each other, and a briefly trained model predicts nearly as in fp32
through the real loading path."""

import dataclasses

import pytest
import torch
from torch import nn

from transformer import checkpoint
from transformer.batching import pad
from transformer.decoding import DecodeConfig, load_decoder, translate_ids
from transformer.errors import ConfigError
from transformer.fast import RuntimeConfig
from transformer.fast.int8 import Int8Linear, quantize_int8

from .briefly_trained import multi30k_corpus, trained_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    corpus = multi30k_corpus()
    path = tmp_path_factory.mktemp("int8") / "model.pt"
    model, tokenizer = trained_model(corpus, {"tie_output": False})
    checkpoint.save(path, model, tokenizer, {}, step=0)
    return path, (corpus[0][:32], corpus[1][:32])


@pytest.mark.parametrize("fast", [True, False])
def test_int8_decoding_agrees_with_fp32(saved, fast):
    """Next-token choices agree almost everywhere; whole translations of this barely trained model
    (its best token has a third of the probability on average) diverge more, once a near tie flips."""
    path, (de, en) = saved
    runtime = RuntimeConfig(fast=fast)
    _, fp32, tokenizer, _ = load_decoder(str(path), [], "cpu", runtime)
    _, int8, _, _ = load_decoder(str(path), [], "cpu", runtime, precision="int8")
    assert not [m for m in int8.modules() if isinstance(m, nn.Linear)]  # every one quantized
    assert any(isinstance(m, Int8Linear) for m in int8.modules())
    sources = tokenizer.source.encode(de)
    src = pad([s + [tokenizer.eos_id] for s in sources], tokenizer.pad_id)
    tgt = pad([[tokenizer.bos_id] + t for t in tokenizer.encode(en)], tokenizer.pad_id)
    with torch.no_grad():
        expected, got = fp32(src, tgt).log_softmax(-1), int8(src, tgt).log_softmax(-1)
    real = tgt != tokenizer.pad_id
    assert (expected.argmax(-1) == got.argmax(-1))[real].float().mean() >= 0.95
    assert (expected.exp() * (expected - got)).sum(-1)[real].mean() < 0.01  # KL(fp32 || int8) per token
    cfg = DecodeConfig(strategy="greedy")
    ours = translate_ids(fp32, sources, tokenizer, cfg, "cpu")
    quantized = translate_ids(int8, sources, tokenizer, dataclasses.replace(cfg, precision="int8"), "cpu")
    assert sum(a[0].tokens == b[0].tokens for a, b in zip(ours, quantized)) >= 0.4 * len(sources)


def test_int8_is_refused_off_the_cpu(saved):
    with pytest.raises(ConfigError, match="decode.precision=int8"):
        load_decoder(str(saved[0]), [], "cuda", precision="int8")


def test_int8_is_a_decoding_precision_only():
    assert DecodeConfig(precision="int8").precision == "int8"
    with pytest.raises(ValueError, match="decode.precision"):
        DecodeConfig(precision="int4")


def test_int8_rows_are_independent_and_close_to_fp32():
    """Each row is quantized by its own scale: a row's output is the same alone or batched with a
    row 100 times larger (one scale per call, as torch's dynamic quantization has, fails this),
    and within int8's rounding of the fp32 product."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    model = quantize_int8(nn.Sequential(linear))
    x = torch.randn(3, 64)
    with torch.no_grad():
        alone, expected = model(x[:1]), linear(x[:1])
        batched = model(torch.cat([x[:1], 100 * x[1:]]))[:1]
    assert torch.equal(alone, batched)
    assert (alone - expected).norm() <= 0.05 * expected.norm()
