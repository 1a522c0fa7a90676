"""The growing key/value cache holds exactly what torch.cat and index_select would give."""

import torch

from transformer.fast import cache
from transformer.fast.cache import GrowingCache


def test_growing_cache_matches_cat_and_index_select_through_growth_and_reorders():
    torch.manual_seed(0)
    grown, reference = GrowingCache(dim=2, min_capacity=4), None
    reorders = {3: torch.tensor([1, 1, 0, 4, 2]), 6: torch.tensor([3, 0, 2]), 11: torch.tensor([2, 0])}
    rows = 5
    for step in range(14):  # capacity 4 -> 8 -> 16; rows 5 -> 5 -> 3 -> 2
        x = torch.randn(rows, 2, 1, 3)
        reference = x if reference is None else torch.cat([reference, x], dim=2)
        torch.testing.assert_close(grown.append(x), reference, rtol=0, atol=0)
        if step in reorders:
            index = reorders[step]
            reference = reference.index_select(0, index)
            grown.reorder(index)
            rows = index.numel()
            torch.testing.assert_close(grown.value, reference, rtol=0, atol=0)
    assert grown.buffer.size(2) == 16  # doubled twice, not once per step


def test_a_reorder_never_overwrites_the_rows_it_reads():
    grown = GrowingCache(dim=1)
    grown.append(torch.arange(4.0).view(4, 1))
    grown.reorder(torch.tensor([3, 2, 1, 0]))  # same rows: in place, every row moves (a swap chain)
    assert grown.value.flatten().tolist() == [3.0, 2.0, 1.0, 0.0]
    grown.reorder(torch.tensor([1, 1, 0]))  # fewer rows: gathered into the spare buffer
    grown.reorder(torch.tensor([2, 0]))  # and back into the first buffer, now the spare
    assert grown.value.flatten().tolist() == [3.0, 2.0]


def test_state_dict_helpers_keep_plain_tensors_for_readers():
    state = {"static": torch.arange(3.0).view(3, 1)}
    cache.append(state, "k", torch.ones(3, 2), dim=1)
    cache.append(state, "k", torch.zeros(3, 1), dim=1)
    assert state["k"].shape == (3, 3) and state["k"][:, 2].eq(0).all()
    cache.reorder(state, torch.tensor([2, 0]))
    assert state["static"].flatten().tolist() == [2.0, 0.0]  # plain tensors are gathered as before
    assert state["k"].shape == (2, 3)


def test_the_whole_buffer_is_finite_past_its_contents():
    """Readers of `cache.whole` mask the empty slots, which must still hold numbers: a masked slot
    gets weight 0, and 0 * NaN is NaN. Memory just freed is full of NaN here, so an allocation
    that reuses it uninitialized shows."""
    state, rows = {}, torch.arange(6)
    for step in range(20):  # capacity 16 -> 32; rows 6 -> 4 (gathered into a new buffer)
        torch.full((6, 2, 64, 8), float("nan")).sum()  # allocated, filled and freed
        cache.append(state, "k", torch.randn(rows.numel(), 2, 1, 8), dim=2)
        if step == 17:
            rows = torch.tensor([5, 0, 2, 2])
            torch.full((6, 2, 64, 8), float("nan")).sum()
            cache.reorder(state, rows)
        buffer, filled = cache.whole(state, "k")
        assert buffer.is_contiguous() and buffer.isfinite().all()
        torch.testing.assert_close(buffer.narrow(2, 0, filled), state["k"], rtol=0, atol=0)
    assert cache.whole(state, "v") is None and cache.whole(state, "k")[0].size(2) == 32
