"""Decoding: search strategies registered by name, corpus translation, ensembles and MBR.

Every search talks to the model through one incremental-state interface:

    memory, _ = model.encode(src, src_mask)               # once per batch of sentences
    state = model.new_state()                             # what the decoder keeps between steps
    logits, _ = model.decode(new_tokens, memory, src_mask, state)
    state.reorder(rows, sources=live)                     # finished sentences leave the batch
    state.reorder_targets(rows)                           # hypotheses move within their sentence

`Transformer` implements it with a key/value cache, `Uncached` by recomputing the whole prefix
(the reference the cache is tested and benchmarked against), `Ensemble` by averaging several
models' probabilities (models.py). Loading a model to decode with, its runtime and precision, is
transformer.translator.Translator's. A target prefix that translations must start with is the
searches' business, not the model's: while a sentence's prefix lasts, `processors.force_prefix` leaves
its next token one choice, so the cache, ensembles and every strategy take it unchanged.

    config.py      DecodeConfig: the decode.* settings
    strategies.py  the strategies by name (greedy, beam, sample) and how they differ
    processors.py  the step every search shares: logits -> log-probabilities (length limits,
                   EOS rules, prefixes), and the one stopping rule of beam searches
    search.py      what every search shares; greedy search and sampling
    beam.py        beam search
    constrained.py beam search whose translations contain given phrases (constraints=true)
    mbr.py         minimum Bayes risk reranking of beam search's n-best lists
    corpus.py      translating a corpus: batches, precision, n-best lists in input order
    inputs.py      target prefixes and constraints: the TAB-separated lines translate.py reads
    alignment.py   word alignments from cross-attention (decode.alignment)
"""

from .beam import beam_search
from .config import DecodeConfig
from .corpus import (
    decode_batch,
    encode_sources,
    translate,
    translate_corpus,
    translate_ids,
    translate_texts,
)
from .inputs import split_constraints, split_prefixes
from .models import Ensemble, Uncached
from .search import Hypothesis, generate, greedy, sampler
from .strategies import STRATEGIES, Strategy

__all__ = [
    "STRATEGIES",
    "DecodeConfig",
    "Ensemble",
    "Hypothesis",
    "Strategy",
    "Uncached",
    "beam_search",
    "decode_batch",
    "encode_sources",
    "generate",
    "greedy",
    "sampler",
    "split_constraints",
    "split_prefixes",
    "translate",
    "translate_corpus",
    "translate_ids",
    "translate_texts",
]
