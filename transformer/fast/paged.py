"""A paged key/value cache: what continuous batching (decoding/engine.py) decodes on.

Keys and values live in fixed-size blocks of one pool allocated up front (PagedAttention, Kwon
et al. 2023). A sequence owns a block table, the list of its blocks in order; the token at
position p is slot p % block_size of block table[p // block_size]. A sequence takes a block when
it grows into one, so the pool holds as many sequences as their actual lengths allow. Sequences
of any lengths join and leave a batch without any cache being concatenated or padded to make
room. Beam search forks a beam by copying its block table and counting one more reference on
each block; a block is copied only when a beam writes into a last block it still shares
(copy-on-write), and it returns to the pool when its last reference goes.

A block holds its positions for every decoder layer, so one block table serves the whole stack.
The encoder's keys and values (cross-attention's, a function of the source alone) are stored the
same way, once per sentence, and shared by its beams.

The model decodes on the pool through its own layers: `PagedState` is a decoding state (see
DecoderState) whose caches are views of the pool for one step's rows, each row at its own
position. A self-attention cache writes the step's keys and values into each row's slot and
gathers each row's blocks into one padded tensor with a mask over the slots past its length: the
same attention as the reference's, on the same numbers. `supports` says which models it runs
(the standard attention; any positions, norms, grouped-query heads, int8 or oneDNN linear
layers). tests/test_paged.py checks it against the reference model's own incremental decoding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..model import DecoderState, LayerCache
from ..model.cache import KeyValueCache


class PoolExhausted(RuntimeError):
    """The pool has no free block left: the caller took more blocks than it made sure of."""


class BlockPool:
    """`n_blocks` blocks of `block_size` positions, each holding keys and values of every layer:
    keys and values are (layers, n_blocks * block_size, kv_heads, head_size) tensors, zeros where
    unwritten (a gathered slot past a sequence's length is masked, and must be finite). Blocks
    carry reference counts; the caller makes sure enough are free before it takes them
    (decoding/engine.py: `Engine.make_room`)."""

    def __init__(self, n_blocks: int, block_size: int, layers: int, kv_heads: int, head_size: int, dtype, device):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs at least one block of at least one slot, got {n_blocks} x {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        shape = (layers, n_blocks * block_size, kv_heads, head_size)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.refs = [0] * n_blocks
        self.free = list(range(n_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.gathered_bytes = 0  # copied by `gather` so far (benchmarks/benchmark_engine.py reports it)
        self.most_used = 0  # the most blocks in use at once so far (serve.py's /health reports it)

    @staticmethod
    def bytes_per_block(block_size: int, layers: int, kv_heads: int, head_size: int, dtype) -> int:
        return 2 * layers * block_size * kv_heads * head_size * torch.empty((), dtype=dtype).element_size()

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    def allocate(self) -> int:
        """A free block, with one reference."""
        if not self.free:
            raise PoolExhausted(f"all {self.n_blocks} blocks are in use")
        block = self.free.pop()
        self.refs[block] = 1
        self.most_used = max(self.most_used, self.n_blocks - len(self.free))
        return block

    def share(self, table: list[int]) -> list[int]:
        """A copy of a block table whose blocks count one more reference (a forked beam)."""
        for block in table:
            self.refs[block] += 1
        return list(table)

    def release(self, table: list[int]) -> None:
        for block in table:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)

    def takes(self, table: list[int], length: int) -> bool:
        """Whether writing position `length` of a sequence takes a block from the pool (`writable`)."""
        index = length // self.block_size
        return index == len(table) or self.refs[table[index]] > 1

    def writable(self, table: list[int], length: int) -> tuple[int, bool]:
        """Make room for position `length` of a sequence: a new block when the last one is full,
        a private copy of the last block when another sequence shares it (copy-on-write).
        Returns the position's flat slot and whether a block was taken from the pool."""
        index, offset = divmod(length, self.block_size)
        if index == len(table):
            table.append(self.allocate())
            return table[index] * self.block_size + offset, True
        if self.refs[table[index]] == 1:
            return table[index] * self.block_size + offset, False
        shared, own = table[index], self.allocate()
        self.refs[shared] -= 1
        src = slice(shared * self.block_size, shared * self.block_size + offset)
        dst = slice(own * self.block_size, own * self.block_size + offset)
        self.keys[:, dst] = self.keys[:, src]  # the filled slots come along
        self.values[:, dst] = self.values[:, src]
        table[index] = own
        return own * self.block_size + offset, True

    def slots(self, tables: list[list[int]], length: int) -> Tensor:
        """(sequences, length) flat slot indices of the first `length` positions of each table,
        padded with slots of block 0 (gathered, then masked)."""
        n = self.blocks_for(length)
        padded = torch.tensor([t[:n] + [0] * (n - len(t[:n])) for t in tables], dtype=torch.long)
        within = torch.arange(self.block_size)
        return (padded[:, :, None] * self.block_size + within).flatten(1)[:, :length].to(self.keys.device)

    def head_major(self, slots: Tensor) -> Tensor:
        """slots (sequences, length) -> the rows of a layer's keys viewed as (slots * kv_heads,
        head_size) that `gather` reads, in (sequence, head, position) order: what it gathers is
        then laid out as attention's batched products read it, with no copy in between."""
        heads = self.keys.size(2)
        return (slots[:, None, :] * heads + torch.arange(heads, device=slots.device)[None, :, None]).flatten()

    def gather(self, layer: int, index: Tensor, sequences: int) -> tuple[Tensor, Tensor]:
        """Keys and values at a `head_major` index -> each (sequences, kv_heads, length, head_size), contiguous."""
        heads, size = self.keys.shape[2:]
        k = self.keys[layer].view(-1, size).index_select(0, index).view(sequences, heads, -1, size)
        v = self.values[layer].view(-1, size).index_select(0, index).view(sequences, heads, -1, size)
        self.gathered_bytes += k.nbytes + v.nbytes
        return k, v


def supports(model) -> str | None:
    """None when the model can decode on a paged cache; otherwise why not."""
    if hasattr(model, "models"):
        return "an ensemble decodes with its members' own caches"
    if model.cfg.attention.kind != "standard":
        return f"model.attention.kind={model.cfg.attention.kind} keeps its own state"
    return None


def pool_shape(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_size) of a model's pool."""
    cfg = model.cfg
    return cfg.n_decoder_layers, cfg.kv_heads, cfg.d_model // cfg.n_heads


@torch.no_grad()
def store_memory(model, pool: BlockPool, memory: Tensor, lengths: list[int], tables: list[list[int]]) -> None:
    """Write each decoder layer's cross-attention keys and values of the encoder output
    (sentences, src_len, d_model), as the layer's own attention makes them, into the sentences'
    blocks (tables: enough blocks each for its `lengths` tokens)."""
    slots = torch.cat([pool.slots([t], n)[0] for t, n in zip(tables, lengths)])
    for i, layer in enumerate(model.decoder_layers):
        attn = layer.cross_attn
        k, v, _ = attn.keys_values(attn.w_k(memory), attn.w_v(memory), None, True)  # (sentences, kv_heads, src_len, head_size)  # fmt: skip
        for pooled, x in ((pool.keys[i], k), (pool.values[i], v)):
            tokens = torch.cat([x[s, :, :n] for s, n in enumerate(lengths)], dim=1)  # (kv_heads, slots, head_size)
            pooled.index_copy_(0, slots, tokens.transpose(0, 1).to(pooled.dtype))


class PagedMemory:
    """The encoder's keys and values of the sentences of a running batch, read from the pool once
    for every layer and kept while the same sentences run in the same order (they never change),
    and their padding mask (sentences, 1, 1, longest): slots (sentences, longest) hold `lengths`
    tokens each."""

    def __init__(self, pool: BlockPool, slots: Tensor, lengths: list[int], dtype: torch.dtype):
        index, sentences = pool.head_major(slots), slots.size(0)
        layers = pool.keys.size(0)
        self.layers = [tuple(t.to(dtype) for t in pool.gather(i, index, sentences)) for i in range(layers)]
        filled = torch.tensor(lengths, device=slots.device)[:, None]
        self.mask = (torch.arange(slots.size(1), device=slots.device) < filled)[:, None, None, :]


class PagedMemoryCache(KeyValueCache):
    """Cross-attention's cache for one layer on a paged batch: the sentences' keys and values,
    and where each decoder row sits among its sentence's rows (`fold`, `width`)."""

    def __init__(self, memory: tuple[Tensor, Tensor], fold: Tensor, width: int):
        super().__init__()
        self.k, self.v = memory
        self.fold, self.width = fold, width

    def sentence_rows(self, rows: int, sentences: int) -> Tensor:
        return torch.div(self.fold, self.width, rounding_mode="floor")

    def folding(self, rows: int, sentences: int) -> tuple[Tensor, int]:
        return self.fold, self.width

    def store(self, k: Tensor, v: Tensor):
        raise RuntimeError("a paged batch's encoder keys and values are in the pool already (store_memory)")


class PagedKeyValueCache(KeyValueCache):
    """Self-attention's cache for one layer on a paged batch: `append` writes each row's new keys
    and values into its slot of the pool and returns every row's history, gathered from its
    blocks into one padded tensor, with a mask over the slots past the row's length."""

    def __init__(self, state: PagedState, layer: int):
        super().__init__()
        self.state, self.layer = state, layer

    def positions(self) -> Tensor:
        return self.state.rows_positions

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        state, pool = self.state, self.state.pool
        if k.size(2) != 1:
            raise ValueError(f"a paged step decodes one token per row, got {k.size(2)}")
        pool.keys[self.layer].index_copy_(0, state.write_slots, k[:, :, 0].to(pool.keys.dtype))
        pool.values[self.layer].index_copy_(0, state.write_slots, v[:, :, 0].to(pool.values.dtype))
        keys, values = pool.gather(self.layer, state.self_index, k.size(0))
        return keys.to(k.dtype), values.to(v.dtype), state.self_mask

    def reorder(self, index: Tensor) -> None:
        raise RuntimeError("a paged batch's rows move by their block tables (decoding/engine.py)")


class PagedState(DecoderState):
    """A decoding state for one step of a paged batch (see DecoderState): rows at their own
    positions, whose layers' caches read and write the pool.

    positions, write_slots: (rows,) each row's position and the slot its keys and values go to;
    self_slots (rows, L) and self_lengths (rows,): the slots each row attends to, this token's
    included; memory: the running sentences' encoder keys and values; fold: (rows,) where each
    row sits in the (sentences * width) grid of cross-attention queries."""

    def __init__(self, pool: BlockPool, positions: Tensor, write_slots: Tensor, self_slots: Tensor, self_lengths: Tensor, memory: PagedMemory, fold: Tensor, width: int):  # fmt: skip
        super().__init__()
        self.pool, self.rows_positions, self.write_slots = pool, positions, write_slots
        self.self_index = pool.head_major(self_slots)
        self.self_mask = (torch.arange(self_slots.size(1), device=positions.device) < self_lengths[:, None])[
            :, None, None, :
        ]
        self.memory, self.fold, self.width = memory, fold, width

    def start(self, n_layers: int) -> None:
        self.layers = [
            LayerCache(PagedKeyValueCache(self, i), PagedMemoryCache(self.memory.layers[i], self.fold, self.width))
            for i in range(n_layers)
        ]

    def positions(self) -> Tensor:
        return self.rows_positions

    def reorder(self, index: Tensor, sources: Tensor | None = None) -> None:
        raise RuntimeError("a paged batch's rows move by their block tables (decoding/engine.py)")

    reorder_targets = reorder
