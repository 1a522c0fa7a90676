"""Key/value caches that grow by one token per decoding step without copying themselves.

Appending with torch.cat copies the whole cache into a new tensor at every step, and beam search
then gathers the surviving beams into yet another one. On CPU each new multi-megabyte tensor also
pays page faults for its fresh memory, so at the base size these copies cost more than the
decoder's matrix products. A GrowingCache keeps the tensor in a buffer with room to spare
(doubling when full): a step writes only its own slice, and a reorder gathers into a second
buffer that is kept for the next reorder.

A layer's cache is a plain dict (see MultiHeadAttention). `append` keeps the name it is given
pointing at the current contents, a view of the buffer, so readers see an ordinary tensor.
`whole` hands out the buffer itself, slots past the contents included: they hold zeros or
earlier rows, never uninitialized memory, so a reader that masks them can use the buffer whole.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROWING = "growing"  # the dict entry that holds the GrowingCache of each appended name


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


def append(state: dict, name: str, x: Tensor, dim: int) -> Tensor:
    """state[name] with x appended along dim; state[name] becomes the result."""
    caches = state.setdefault(GROWING, {})
    if name not in caches:
        caches[name] = GrowingCache(dim)
    state[name] = caches[name].append(x)
    return state[name]


def whole(state: dict, name: str) -> tuple[Tensor, int] | None:
    """The buffer behind state[name], capacity and all, and how many of its slots are filled;
    None when state[name] is not a growing cache. The buffer is contiguous and finite throughout.
    (See MultiHeadAttention.attend, which uses this where reading a narrowed view would copy it.)"""
    grown = state.get(GROWING, {}).get(name)
    if grown is None:
        return None
    return grown.buffer, grown.length


def reorder(state: dict, index: Tensor) -> None:
    """Keep the batch rows in `index` of every tensor in a layer's cache dict."""
    caches = state.get(GROWING, {})
    for name, value in list(state.items()):
        if name == GROWING:
            continue
        if name in caches:
            caches[name].reorder(index)
            state[name] = caches[name].value
        else:
            state[name] = value.index_select(0, index)
