"""Separate source and target vocabularies (data.joint_vocab=false): one SentencePiece model and one
embedding matrix per language, from the tokenizer through the model and the checkpoint to the
translation CLI."""

import gzip
import json

import numpy as np
import pytest
import torch

from transformer.checkpoint import load_model
from transformer.data import DataConfig, load_split
from transformer.data.batching import SubwordSampler, tokenize
from transformer.data.tokenizer import Tokenizer
from transformer.model import ModelConfig, Transformer

from .test_cli import run, train


@pytest.fixture(scope="module")
def separate(shared_corpus) -> tuple[Tokenizer, Tokenizer, Tokenizer]:
    """(the pair's tokenizer, its source model alone, its target model alone), 300 pieces each."""
    ds = load_split(DataConfig(dir=str(shared_corpus)), "train")
    source = Tokenizer.train(list(ds["src"]), vocab_size=300, model_type="unigram")
    target = Tokenizer.train(list(ds["tgt"]), vocab_size=300, model_type="unigram")
    return Tokenizer(target.model_bytes, source.model_bytes), source, target


def test_each_side_is_tokenized_with_its_own_model(separate, shared_corpus):
    tokenizer, source, target = separate
    assert not tokenizer.joint and tokenizer.source.model_bytes == source.model_bytes
    joint = Tokenizer(target.model_bytes)
    assert joint.joint and joint.source is joint
    corpus = tokenize(load_split(DataConfig(dir=str(shared_corpus)), "val"), tokenizer)
    assert corpus.src == source.encode(corpus.src_text) and corpus.tgt == target.encode(corpus.tgt_text)
    assert corpus.src != target.encode(corpus.src_text)  # German through the English model splits otherwise


def test_a_separate_source_model_is_saved_beside_the_target_model_and_loaded_with_it(separate, tmp_path):
    tokenizer, _, target = separate
    tokenizer.save(tmp_path / "spm.model")
    assert (tmp_path / "spm.src.model").read_bytes() == tokenizer.source_bytes
    assert Tokenizer.load(tmp_path / "spm.model").same_as(tokenizer)
    Tokenizer(target.model_bytes).save(tmp_path / "spm.model")  # a joint model in the same place
    assert not (tmp_path / "spm.src.model").exists()
    assert Tokenizer.load(tmp_path / "spm.model").joint


def test_subword_sampling_draws_each_side_from_its_own_model(separate, shared_corpus):
    tokenizer, _, _ = separate
    corpus = tokenize(load_split(DataConfig(dir=str(shared_corpus)), "val"), tokenizer)
    drawn = SubwordSampler(corpus, tokenizer, DataConfig(subword_alpha=0.1)).draw(np.random.default_rng(0))
    assert drawn.src != corpus.src and drawn.tgt != corpus.tgt
    assert tokenizer.source.decode(drawn.src) == tokenizer.source.decode(corpus.src)
    assert tokenizer.decode(drawn.tgt) == tokenizer.decode(corpus.tgt)


def test_the_encoder_reads_its_own_embedding():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, src_vocab_size=80, n_encoder_layers=1, n_decoder_layers=1, d_model=32, n_heads=4, d_ff=64, tie_output=False)  # fmt: skip
    model = Transformer(cfg)
    assert model.src_embed.embed.weight.shape == (80, 32) and model.embed.embed.weight.shape == (50, 32)
    src, tgt = torch.tensor([[79, 60, 3]]), torch.tensor([[2, 7]])  # source ids the target vocabulary lacks
    model(src, tgt).sum().backward()
    source_grad, target_grad = model.src_embed.embed.weight.grad, model.embed.embed.weight.grad
    assert source_grad[[79, 60, 3]].abs().sum(1).min() > 0 and source_grad[[2, 7]].abs().sum() == 0
    assert target_grad[[2, 7]].abs().sum(1).min() > 0 and target_grad[3].abs().sum() == 0


@pytest.mark.e2e
def test_train_and_translate_with_separate_vocabularies(tmp_path, shared_corpus):
    run_dir = tmp_path / "separate"
    result = train(
        run_dir,
        f"data.dir={shared_corpus}",
        "data.vocab_size=300",
        "data.joint_vocab=false",
        "data.subword_alpha=0.1",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        "unigram tokenizers of 300 pieces for the source and 300 for the target" in (run_dir / "train.log").read_text()
    )
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 20
    model, tokenizer, _ = load_model(run_dir / "checkpoint_best.pt")
    assert not tokenizer.joint and tokenizer.same_as(Tokenizer.load(run_dir / "spm.model"))
    assert model.cfg.src_vocab_size == 300 and model.src_embed is not None
    sentences = gzip.decompress((shared_corpus / "test_2016_flickr.de.gz").read_bytes()).decode()
    translated = run(
        "translate.py", f"checkpoint={run_dir / 'checkpoint_best.pt'}", "decode.max_len_b=5", stdin=sentences
    )
    assert translated.returncode == 0, translated.stderr
    assert translated.stdout.splitlines() == (run_dir / "test_2016_flickr.beam5.en").read_text().splitlines()
