"""Key/value caches that grow by one token per decoding step without copying themselves.

Appending with torch.cat copies the whole cache into a new tensor at every step, and beam search
then gathers the surviving beams into yet another one. On CPU each new multi-megabyte tensor also
pays page faults for its fresh memory, so at the base size these copies cost more than the
decoder's matrix products. A GrowingCache keeps the tensor in a buffer with room to spare
(doubling when full): a step writes only its own slice, and a reorder gathers into a second
buffer that is kept for the next reorder.

FastKeyValueCache, the cache object the fast runtime's decoding states make (see
KeyValueCache in model/attention.py), keeps a layer's keys and values in two of them. Its `k`
and `v` are views of the buffers' contents, so readers see ordinary tensors; under bf16 it may
hand attention the buffers whole, slots past the contents included: they hold zeros or earlier
rows, never uninitialized memory, so attention masks them and reads the buffer in place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..model.cache import KeyValueCache


class GrowingCache:
    """One cached tensor (batch first) that grows along `dim`."""

    def __init__(self, dim: int, min_capacity: int = 16):
        self.dim, self.min_capacity, self.length = dim, min_capacity, 0
        self.buffer: Tensor | None = None  # the current rows; its first `length` slots along dim are filled
        self.spare: Tensor | None = None  # where the next reorder gathers to

    @property
    def value(self) -> Tensor:
        return self.buffer.narrow(self.dim, 0, self.length)

    def append(self, x: Tensor) -> Tensor:
        """Write x after the current contents; return all of it (a view, valid until the next call)."""
        new_length = self.length + x.size(self.dim)
        if self.buffer is None or new_length > self.buffer.size(self.dim) or self.buffer.dtype != x.dtype:
            self.grow(max(new_length, 2 * self.length, self.min_capacity), x)
        self.buffer.narrow(self.dim, self.length, x.size(self.dim)).copy_(x)
        self.length = new_length
        return self.value

    def grow(self, capacity: int, like: Tensor) -> None:
        shape = list(like.shape)
        shape[self.dim] = capacity
        buffer = like.new_zeros(shape)  # finite past the contents too (see `whole`)
        if self.length:
            buffer.narrow(self.dim, 0, self.length).copy_(self.value)
        self.buffer, self.spare = buffer, None

    def reorder(self, index: Tensor) -> None:
        """Keep the rows in `index`, in that order (beam search's survivors, or the unfinished rows).

        With as many rows as before, only the rows that change are copied, in place: beam search
        keeps a beam in its parent's slot where it can (see decoding/beam.py: stay_in_place), so most
        rows stay. Fewer rows gather into the spare buffer."""
        rows = index.numel()
        if rows == self.buffer.size(0):
            moved = (index != torch.arange(rows, device=index.device)).nonzero().flatten()
            if moved.numel():
                value = self.value
                value.index_copy_(0, moved, value.index_select(0, index[moved]))  # reads before it writes
            return
        if self.spare is None or self.spare.size(0) < rows:
            self.spare = self.buffer.new_zeros((rows, *self.buffer.shape[1:]))
        target = self.spare[:rows]
        torch.index_select(self.value, 0, index, out=target.narrow(self.dim, 0, self.length))
        self.buffer, self.spare = target, self.buffer


class FastKeyValueCache(KeyValueCache):
    """The reference KeyValueCache with self-attention's keys and values in GrowingCaches, and
    the encoder's stored contiguous, once (in fp32 under bf16 on a CPU with runtime.fp32_cross,
    where a decoding step's products are faster: `cross_dtype`).

    `whole` hands out the buffers whole with a mask over the slots past the tokens so far, which
    FastMultiHeadAttention attends to under bf16 on a CPU: torch's batched product copies an
    operand whose batches are not packed one after the other, and a narrowed view of a longer
    buffer is not; the whole buffer is, so the products read it in place, with the same result,
    although they score up to twice the keys. In fp32 the product reads the view in place."""

    def __init__(self, fp32_cross: bool = False):
        super().__init__()
        self.fp32_cross = fp32_cross
        self.keys: GrowingCache | None = None
        self.values: GrowingCache | None = None

    def positions(self) -> int:
        return 0 if self.keys is None else self.keys.length

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        if self.keys is None:
            self.keys, self.values = GrowingCache(dim=2), GrowingCache(dim=2)
        self.k, self.v = self.keys.append(k), self.values.append(v)
        return self.k, self.v, None

    def whole(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The keys' and values' whole buffers and a (1, 1, 1, capacity) mask of the filled slots;
        the contents and None when the buffers are full."""
        if self.keys.length == self.keys.buffer.size(2):
            return self.k, self.v, None
        filled = torch.arange(self.keys.buffer.size(2), device=self.k.device) < self.keys.length
        return self.keys.buffer, self.values.buffer, filled.view(1, 1, 1, -1)

    def store(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # Contiguous, once: as views of the projections, the batched products of every later
        # step would copy them again to fold batch and heads together.
        # (`.to(memory_format=...)` would hand the view back unchanged when the dtype matches.)
        dtype = cross_dtype(self.fp32_cross, k.dtype, k.device)
        return super().store(k.to(dtype).contiguous(), v.to(dtype).contiguous())

    def reorder(self, index: Tensor) -> None:
        if self.keys is None:  # the encoder's keys and values
            return super().reorder(index)
        self.keys.reorder(index)
        self.values.reorder(index)
        self.k, self.v = self.keys.value, self.values.value
        self.reorder_extra(index)


def cross_dtype(fp32_cross: bool, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype cross-attention keys and values are kept and attended in for a step computed in
    `dtype` on `device`: fp32 under bf16 on a CPU where runtime.fp32_cross asks for it, else dtype."""
    return torch.float32 if fp32_cross and dtype == torch.bfloat16 and device.type == "cpu" else dtype
