"""What incremental decoding keeps between steps: a KeyValueCache per attention, a LayerCache per
decoder layer, and the DecoderState of the whole decoder (the searches of transformer/decoding/
make one with `Transformer.new_state` and hand it to every `decode` call).

These are the reference caches: keys and values joined with torch.cat. The fast runtime's grow in
place (transformer/fast/cache.py) and the continuous engine's live in a paged pool
(transformer/fast/paged.py); attention and the layers see only the methods defined here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor


def consecutive_rows(rows: int, sentences: int, device) -> Tensor:
    """(rows,) the sentence of each decoder row when each sentence's rows are consecutive and as
    many for each (beam search's k beams): 0, 0, ..., 1, 1, ..."""
    return torch.arange(sentences, device=device).repeat_interleave(rows // sentences)


class KeyValueCache:
    """What one attention layer keeps between decoding steps, batch first: the keys and values
    (batch, kv_heads, length, head_size) of the tokens so far (self-attention, `append`) or of
    the encoder output (cross-attention, `store`), and a variant's own tensors (`extra`).

    This is the reference: it joins each step's keys and values to the earlier ones with
    torch.cat. The caches of transformer/fast/ keep the same contents in buffers that grow in
    place, or in the blocks of a shared pool (paged); attention sees only these methods."""

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.extra: dict[str, Tensor] = {}  # e.g. DCMHA's key weights, (batch, length, features)

    def positions(self) -> int | Tensor:
        """The position of the next token: one for every row, or a (batch,) tensor of each row's."""
        return 0 if self.k is None else self.k.size(2)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """This step's keys and values after the earlier ones. Returns the keys and values to
        attend to, and None, or a mask (True: attend) over their slots where some are not tokens."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v, None

    def memory(self) -> tuple[Tensor, Tensor] | None:
        """The stored keys and values of the encoder output, one row per sentence; None before `store`."""
        return None if self.k is None else (self.k, self.v)

    def store(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keep the encoder output's keys and values for the later steps; returns them as kept."""
        self.k, self.v = k, v
        return k, v

    def sentence_rows(self, rows: int, sentences: int) -> Tensor:
        """(rows,) the sentence (row of `memory`) each of `rows` decoder rows reads."""
        return consecutive_rows(rows, sentences, self.k.device)

    def folding(self, rows: int, sentences: int) -> tuple[Tensor | None, int]:
        """The same, as a grid of `sentences` x width places for a fast path that folds each
        sentence's rows into one query: (None, width) when the rows are consecutive, `width` per
        sentence, or ((rows,) each row's place in the grid, width)."""
        return None, rows // sentences

    def reorder(self, index: Tensor) -> None:
        """Keep the batch rows in `index`, in that order."""
        self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)
        self.reorder_extra(index)

    def reorder_extra(self, index: Tensor) -> None:
        """The attention variants' per-row state (`extra`) follows the rows."""
        self.extra = {name: t.index_select(0, index) for name, t in self.extra.items()}


@dataclass
class LayerCache:
    """One decoder layer's caches: its self-attention's and its cross-attention's."""

    self: KeyValueCache
    cross: KeyValueCache


@dataclass
class DecoderState:
    """What incremental decoding keeps between steps: one LayerCache per decoder layer, made by
    `new_cache` (the reference KeyValueCache; transformer/fast/ gives caches that grow in place
    or live in a paged pool), and the number of target tokens decoded so far."""

    layers: list[LayerCache] = field(default_factory=list)
    length: int = 0  # target tokens already decoded; the next token's position
    new_cache: Callable[[], KeyValueCache] = KeyValueCache

    def start(self, n_layers: int) -> None:
        """Make the layers' empty caches (at the first step)."""
        self.layers = [LayerCache(self.new_cache(), self.new_cache()) for _ in range(n_layers)]

    def positions(self) -> int | Tensor:
        """The position of the next token: one int for every row, or (rows,) each row's own."""
        return self.length

    def advance(self, tokens: int) -> None:
        self.length += tokens

    def reorder(self, index: Tensor, sources: Tensor | None = None) -> None:
        """Keep the batch rows in `index` (in that order), e.g. the unfinished sentences.

        sources: the rows to keep of the cross-attention caches, which hold one row per source
        sentence; by default the same as index. (Beam search keeps one per sentence for its k
        beams and passes the surviving sentences.)"""
        for layer in self.layers:
            layer.self.reorder(index)
            if layer.cross.memory() is not None:
                layer.cross.reorder(index if sources is None else sources)

    def reorder_targets(self, index: Tensor) -> None:
        """Keep the target rows in `index` (beam search moving hypotheses between the beams of one
        sentence); the cross-attention caches, a function of the sources alone, stay as they are."""
        for layer in self.layers:
            layer.self.reorder(index)
