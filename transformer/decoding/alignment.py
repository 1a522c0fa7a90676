"""Word alignments from cross-attention (`decode.alignment=true`): for each word of a translation,
the source word its subword pieces attend to most, as Pharaoh/fairseq `i-j` pairs (source word i,
target word j, both counted from 0 over the whitespace-separated words of the detokenized texts).

The translation is read once more by the decoder, as in training (BOS + its tokens), and the
cross-attention of one decoder layer (`decode.alignment_layer`, default the last), averaged
over its heads and over the members of an ensemble, is summed from the pieces of each target word
onto the pieces of each source word; the source's EOS takes no part. A target piece is aligned by
the attention of the step that predicts it. Chen et al. (2020, "Accurate word alignment induction
from neural machine translation") align it by the next step, which reads it as input; on our
models that was worse at every layer. docs/DECODING.md has the measurements behind both choices,
against hand-made gold alignments (tests/data/alignment/).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..data.batching import pad, token_batches
from ..errors import ConfigError
from ..model import padding_mask
from .models import Ensemble, Uncached


def transformers(model) -> list:
    """The Transformer models inside what a search decodes with (a model, Uncached or an Ensemble)."""
    if isinstance(model, Ensemble):
        return model.models
    if isinstance(model, Uncached):
        return [model.model]
    return [model]


@torch.no_grad()
def cross_attention(model, src: Tensor, tgt_in: Tensor, layer: int) -> Tensor:
    """src (batch, src_len) and tgt_in (batch, tgt_len: BOS + tokens) -> (batch, tgt_len, src_len)
    attention of decoder layer `layer` from each target position to the source, averaged over its
    heads and the ensemble's members."""
    members = transformers(model)
    n_layers = members[0].cfg.n_decoder_layers
    if not -n_layers <= layer < n_layers:
        raise ConfigError(f"decode.alignment_layer={layer}, but the decoder has {n_layers} layers")
    src_mask = padding_mask(src, members[0].cfg.pad_id)
    total = 0
    for member in members:
        memory, _ = member.encode(src, src_mask)
        _, weights = member.decode(tgt_in, memory, src_mask, need_weights=True)
        total = total + weights[layer]["cross"].float().mean(1)  # (batch, tgt_len, src_len)
    return total / len(members)


def words_of_pieces(tokenizer, ids: list[int]) -> list[int]:
    """The whitespace-separated word of the detokenized text that each piece falls in."""
    prefixes = tokenizer.decode([ids[: i + 1] for i in range(len(ids))])
    return [max(len(text.split()) - 1, 0) for text in prefixes]


def word_links(attention: Tensor, src_words: list[int], tgt_words: list[int]) -> list[tuple[int, int]]:
    """attention (tgt_pieces, src_pieces) -> one (source word, target word) link per target word:
    the source word whose pieces get the most attention from the target word's pieces."""
    if not src_words or not tgt_words:
        return []
    by_source = torch.zeros(attention.size(0), src_words[-1] + 1).index_add_(1, torch.tensor(src_words), attention)
    by_word = torch.zeros(tgt_words[-1] + 1, by_source.size(1)).index_add_(0, torch.tensor(tgt_words), by_source)
    return [(int(i), j) for j, i in enumerate(by_word.argmax(1).tolist())]


def align(
    model, tokenizer, sources: list[list[int]], targets: list[list[int]], layer: int, device, shift: bool = False
) -> list[list[tuple[int, int]]]:
    """Word links of each (source ids, target ids) pair, in input order. shift=True aligns each
    target piece by the step that reads it (Chen et al.'s shift) instead of the step that predicts it."""
    lengths = np.array([len(s) + len(t) + 2 for s, t in zip(sources, targets)], dtype=np.int64)
    out: list[list[tuple[int, int]]] = [[] for _ in sources]
    for indices in token_batches(lengths, 4096):
        src = pad([sources[i] + [tokenizer.eos_id] for i in indices], tokenizer.pad_id).to(device)
        tgt_in = pad([[tokenizer.bos_id] + targets[i] for i in indices], tokenizer.pad_id).to(device)
        attention = cross_attention(model, src, tgt_in, layer).cpu()
        for row, i in enumerate(indices):
            n_src, n_tgt = len(sources[i]), len(targets[i])
            steps = attention[row, int(shift) : n_tgt + int(shift), :n_src]  # (n_tgt, n_src), without the EOS
            src_words = words_of_pieces(tokenizer.source, sources[i])
            out[i] = word_links(steps, src_words, words_of_pieces(tokenizer, targets[i]))
    return out


def align_translations(model, texts: list[str], n_best: list[list], tokenizer, cfg, device) -> list[list[str]]:
    """The `i-j` alignment of each hypothesis of each text's n-best list, in the same layout."""
    limit = transformers(model)[0].cfg.max_positions - 1  # sources truncated as they were translated
    sources = [ids[:limit] for ids in tokenizer.source.encode(texts)]
    pairs = [(i, h.tokens) for i, hyps in enumerate(n_best) for h in hyps]
    links = align(model, tokenizer, [sources[i] for i, _ in pairs], [t for _, t in pairs], cfg.alignment_layer, device)
    out: list[list[str]] = [[] for _ in n_best]
    for (i, _), sentence_links in zip(pairs, links):
        out[i].append(pharaoh(sentence_links))
    return out


def alignment_error(
    predicted: list[set], sure: list[set], possible: list[set] | None = None
) -> tuple[float, float, float]:
    """Precision, recall and alignment error rate (Och and Ney, 2003) of predicted links against
    gold sure links S and possible links P (S when not given; S is a subset of P):
    AER = 1 - (|A & S| + |A & P|) / (|A| + |S|)."""
    possible = possible or sure
    a = sum(len(p) for p in predicted)
    s = sum(len(g) for g in sure)
    a_s = sum(len(p & g) for p, g in zip(predicted, sure))
    a_p = sum(len(p & g) for p, g in zip(predicted, possible))
    return a_p / max(a, 1), a_s / max(s, 1), 1 - (a_s + a_p) / max(a + s, 1)


def read_pharaoh(line: str) -> set[tuple[int, int]]:
    """`i-j i-j ...` -> {(i, j), ...}."""
    return {tuple(int(x) for x in pair.split("-")) for pair in line.split()}


def pharaoh(links: list[tuple[int, int]]) -> str:
    """Links as `i-j` pairs (source-target), separated by spaces."""
    return " ".join(f"{i}-{j}" for i, j in links)
