"""A tiny model briefly trained on a few hundred Multi30k pairs, with SentencePiece models trained
on them: enough that it ends its translations with EOS, for tests that compare two ways of
decoding it (CTranslate2 export, int8)."""

import gzip

import torch
import torch.nn.functional as F

from transformer.data.batching import pad
from transformer.data.tokenizer import Tokenizer
from transformer.model import ModelConfig, Transformer

from .conftest import ROOT

MULTI30K = ROOT / "data" / "multi30k"


def lines(split: str, lang: str, count: int, offset: int = 0) -> list[str]:
    with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return f.read().splitlines()[offset : offset + count]


def multi30k_corpus():
    """300 short training pairs, and the joint and separate tokenizers trained on them."""
    pairs = [(de, en) for de, en in zip(lines("train", "de", 3000), lines("train", "en", 3000)) if len(de) < 60][:300]
    de, en = [p[0] for p in pairs], [p[1] for p in pairs]
    joint = Tokenizer.train(de + en, vocab_size=200, model_type="unigram")
    target = Tokenizer.train(en, vocab_size=160, model_type="unigram")
    separate = Tokenizer(target.model_bytes, Tokenizer.train(de, vocab_size=180, model_type="unigram").model_bytes)
    return de, en, joint, separate


def trained_model(corpus, options: dict, steps: int = 120) -> tuple[Transformer, Tokenizer]:
    """A tiny model trained briefly, enough that it ends its translations with EOS."""
    de, en, joint, separate = corpus
    options = dict(options)
    tokenizer = separate if options.pop("separate", False) else joint
    src_vocab = None if tokenizer.joint else len(tokenizer.source)
    torch.manual_seed(0)
    cfg = ModelConfig(len(tokenizer), src_vocab_size=src_vocab, n_encoder_layers=1, n_decoder_layers=2,
                      d_model=32, n_heads=4, d_ff=64, dropout=0.0, max_positions=128, **options)  # fmt: skip
    model = Transformer(cfg)
    src, tgt = tokenizer.source.encode(de), tokenizer.encode(en)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = torch.randint(len(src), (24,), generator=generator).tolist()
        src_batch = pad([src[i] + [tokenizer.eos_id] for i in rows], tokenizer.pad_id)
        tgt_batch = pad([[tokenizer.bos_id] + tgt[i] + [tokenizer.eos_id] for i in rows], tokenizer.pad_id)
        logits = model(src_batch, tgt_batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_batch[:, 1:].flatten(), ignore_index=tokenizer.pad_id)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), tokenizer
