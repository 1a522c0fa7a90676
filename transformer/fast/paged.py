"""A paged key/value cache and the decoder step that reads it: what continuous batching
(serving/continuous.py) runs on.

Keys and values live in fixed-size blocks of one pool allocated up front (PagedAttention, Kwon
et al. 2023). A sequence owns a block table, the list of its blocks in order; the token at
position p is slot p % block_size of block table[p // block_size]. Sequences of any lengths join
and leave a batch without any cache being concatenated, padded or copied to make room, and the
memory is bounded by the pool. Beam search forks a beam by copying its block table and counting
one more reference on each block; a block is copied only when a beam writes into a last block it
still shares (copy-on-write), and it returns to the pool when its last reference goes.

A block holds its positions for every decoder layer, so one block table serves the whole stack.
The encoder's keys and values (cross-attention's, a function of the source alone) are stored the
same way, once per sentence, and shared by its beams.

A step gathers each sequence's blocks into one padded tensor per layer and attends with a mask
over the slots past its length: the same attention as the reference's, on the same numbers.
`PagedDecoder.supports` says which models it can run (the standard attention; any positions,
norms, grouped-query heads, int8 or oneDNN linear layers). tests/test_paged.py checks it against
the reference model's own incremental decoding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..blocks import LearnedPositions, NoPositions, SinusoidalPositions
from .attention import cross_dtype, fast_attention


class PoolExhausted(RuntimeError):
    """The pool has no free block left: the caller reserved fewer blocks than it used."""


class BlockPool:
    """`n_blocks` blocks of `block_size` positions, each holding keys and values of every layer:
    keys and values are (layers, n_blocks * block_size, kv_heads, head_size) tensors, zeros where
    unwritten (a gathered slot past a sequence's length is masked, and must be finite).

    Blocks carry reference counts. `reserve` promises blocks to a caller ahead of use, so that a
    sentence admitted into a batch can never run out of blocks half-way: new work waits instead.
    A promise is the most a caller holds at once (not every block it ever takes: a beam's old
    blocks return as it moves on)."""

    def __init__(self, n_blocks: int, block_size: int, layers: int, kv_heads: int, head_size: int, dtype, device):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs at least one block of at least one slot, got {n_blocks} x {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        shape = (layers, n_blocks * block_size, kv_heads, head_size)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.refs = [0] * n_blocks
        self.free = list(range(n_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.promised = 0  # blocks promised to the callers of `reserve`, in use or not

    @staticmethod
    def bytes_per_block(block_size: int, layers: int, kv_heads: int, head_size: int, dtype) -> int:
        return 2 * layers * block_size * kv_heads * head_size * torch.empty((), dtype=dtype).element_size()

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    def reserve(self, n: int) -> bool:
        """Promise n blocks to a caller that will never hold more than n at once; False (and
        nothing promised) when the promises made so far leave fewer than n."""
        if self.promised + n > self.n_blocks:
            return False
        self.promised += n
        return True

    def unreserve(self, n: int) -> None:
        self.promised -= n

    def allocate(self) -> int:
        """A free block, with one reference."""
        if not self.free:
            raise PoolExhausted(f"all {self.n_blocks} blocks are in use")
        block = self.free.pop()
        self.refs[block] = 1
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
        return k, v


class PagedDecoder:
    """One decoding step for a batch of sequences at different positions, reading and writing a
    BlockPool, with the model's own modules (so its fast paths and int8 layers run as usual)."""

    def __init__(self, model, pool: BlockPool):
        self.model, self.pool = model, pool
        self.cross: tuple[object, list[tuple[Tensor, Tensor]]] = (None, [])  # see cross_keys_values

    @staticmethod
    def supports(model) -> str | None:
        """None when the model can decode paged; otherwise why not."""
        cfg = model.cfg
        if hasattr(model, "models"):
            return "an ensemble decodes with its members' own caches"
        if cfg.attention.kind != "standard":
            return f"model.attention.kind={cfg.attention.kind} keeps its own state"
        return None

    @staticmethod
    def pool_shape(model) -> tuple[int, int, int]:
        """(layers, kv_heads, head_size) of a model's pool."""
        cfg = model.cfg
        return cfg.n_decoder_layers, cfg.kv_heads, cfg.d_model // cfg.n_heads

    @torch.no_grad()
    def store_memory(self, memory: Tensor, lengths: list[int], tables: list[list[int]]) -> None:
        """Write each decoder layer's cross-attention keys and values of the encoder output
        (sentences, src_len, d_model) into the sentences' blocks (tables: enough blocks each)."""
        slots = torch.cat([self.pool.slots([t], n)[0] for t, n in zip(tables, lengths)])
        rows = torch.cat([torch.arange(n) + i * memory.size(1) for i, n in enumerate(lengths)]).to(memory.device)
        for i, layer in enumerate(self.model.decoder_layers):
            attn = layer.cross_attn
            k = attn.w_k(memory).flatten(0, 1).index_select(0, rows).unflatten(-1, (attn.n_kv_heads, attn.d_head))
            v = attn.w_v(memory).flatten(0, 1).index_select(0, rows).unflatten(-1, (attn.n_kv_heads, attn.d_head))
            self.pool.keys[i].index_copy_(0, slots, k.to(self.pool.keys.dtype))
            self.pool.values[i].index_copy_(0, slots, v.to(self.pool.values.dtype))

    @torch.no_grad()
    def step(
        self,
        tokens: Tensor,
        positions: Tensor,
        write_slots: Tensor,
        self_slots: Tensor,
        self_lengths: Tensor,
        cross_slots: Tensor,
        cross_lengths: Tensor,
        fold: Tensor,
        width: int,
        cross_key: object = None,
    ) -> Tensor:
        """Logits (rows, vocab) of the next token of each row.

        tokens, positions, write_slots: (rows,) each row's last token, its position and the slot
        its keys and values go to. self_slots (rows, L) and self_lengths (rows,): the slots each
        row attends to, this token's included. cross_slots (sentences, S) and cross_lengths: each
        sentence's encoder keys and values. fold: (rows,) where each row's query sits in the
        (sentences * width) grid of cross-attention queries: a sentence's beams attend together
        to its one copy of the memory. cross_key: see cross_keys_values."""
        model, pool = self.model, self.pool
        sentences = cross_slots.size(0)
        x = model.embed(tokens[:, None])
        x = add_positions(model.positions, x, positions)
        self_mask = (torch.arange(self_slots.size(1), device=x.device) < self_lengths[:, None])[:, None, None, :]
        cross_mask = (torch.arange(cross_slots.size(1), device=x.device) < cross_lengths[:, None])[:, None, None, :]
        self_index = pool.head_major(self_slots)
        turn = None  # the rotary angles of this step
        cross = self.cross_keys_values(cross_slots, cross_key)
        for i, layer in enumerate(model.decoder_layers):
            attn = layer.self_attn
            h = layer.self_attn_norm.before(x)
            q = attn.split_heads(attn.w_q(h), attn.n_heads)  # (rows, heads, 1, head_size)
            k = attn.split_heads(attn.w_k(h), attn.n_kv_heads)
            v = attn.split_heads(attn.w_v(h), attn.n_kv_heads)
            if attn.rotary is not None:  # one rotary for all layers: its angles once per step
                turn = angles(attn.rotary, positions, q.dtype) if turn is None else turn
                q, k = attn.rotary.turn(q, *turn), attn.rotary.turn(k, *turn)
            pool.keys[i].index_copy_(0, write_slots, k[:, :, 0].to(pool.keys.dtype))
            pool.values[i].index_copy_(0, write_slots, v[:, :, 0].to(pool.values.dtype))
            keys, values = pool.gather(i, self_index, tokens.size(0))
            out = self.attend(q, keys, values, self_mask)
            x = layer.self_attn_norm.after(x, attn.w_o(attn.combine_heads(out, h)))

            attn = layer.cross_attn
            h = layer.cross_attn_norm.before(x)
            q = attn.split_heads(attn.w_q(h), attn.n_heads)[:, :, 0]  # (rows, heads, head_size)
            grid = q.new_zeros(sentences * width, *q.shape[1:]).index_copy_(0, fold, q)
            grid = grid.view(sentences, width, *q.shape[1:]).transpose(1, 2)  # (sentences, heads, width, head_size)
            out = self.attend(grid, *cross[i], cross_mask, cross_dtype(attn, grid))
            out = out.transpose(1, 2).flatten(0, 1).index_select(0, fold)[:, :, None]  # (rows, heads, 1, head_size)
            x = layer.cross_attn_norm.after(x, attn.w_o(attn.combine_heads(out, h)))
            x = layer.ffn_norm.after(x, layer.ffn(layer.ffn_norm.before(x)))
        return model.project(model.decoder_norm(x))[:, 0]

    def cross_keys_values(self, cross_slots: Tensor, key: object) -> list[tuple[Tensor, Tensor]]:
        """Every layer's encoder keys and values of the sentences at `cross_slots`, gathered. The
        encoder's keys and values of a sentence never change, so while the same sentences run in
        the same order (the caller's `key`, not None, names them) the last gather is used again."""
        if key is None or self.cross[0] != key:
            index, sentences = self.pool.head_major(cross_slots), cross_slots.size(0)
            gathered = [self.pool.gather(i, index, sentences) for i in range(len(self.model.decoder_layers))]
            self.cross = (key, gathered)
        return self.cross[1]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Attention of q on keys and values read from the pool, in q's dtype, or in `dtype` (the
        cross-attention's `cross_dtype`, as FastMultiHeadAttention attends from its cache)."""
        if dtype is not None and dtype != q.dtype:
            with torch.autocast(q.device.type, enabled=False):
                return fast_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, 0.0).to(q.dtype)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        return fast_attention(q, k, v, mask, 0.0)


def add_positions(positions, x: Tensor, at: Tensor) -> Tensor:
    """x (rows, 1, d_model) plus each row's position encoding at its own position `at` (rows,)."""
    if isinstance(positions, SinusoidalPositions):
        return x + positions.table.index_select(0, at)[:, None].to(x.dtype)
    if isinstance(positions, LearnedPositions):
        return x + positions.embed.weight.index_select(0, at)[:, None]
    if isinstance(positions, NoPositions):
        return x
    raise TypeError(f"no paged positions for {type(positions).__name__}")


def angles(rotary, at: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The cosines and sines of the rotary angles of each row's position `at` (rows,), shaped for
    `rotary.turn` on (rows, heads, 1, head_size)."""
    cos = rotary.cos.index_select(0, at)[:, None, None].to(dtype)  # (rows, 1, 1, head_size / 2)
    return cos, rotary.sin.index_select(0, at)[:, None, None].to(dtype)
