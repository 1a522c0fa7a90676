"""The growing key/value cache holds exactly what torch.cat and index_select would give."""

import torch

from transformer.fast.cache import FastKeyValueCache, GrowingCache
from transformer.model.cache import KeyValueCache


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


def test_the_fast_cache_object_holds_what_the_reference_cache_holds():
    """FastKeyValueCache (growing buffers) against KeyValueCache (torch.cat), through appends,
    reorders and a variant's own tensors (`extra`): the same keys, values and positions."""
    torch.manual_seed(0)
    fast, reference = FastKeyValueCache(), KeyValueCache()
    for step in range(20):  # capacity 16 -> 32
        k, v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
        for c in (fast, reference):
            got_k, got_v, mask = c.append(k, v)
            assert mask is None  # fp32: the cache's contents, no masked slots
            c.extra["w"] = torch.full((3, step + 1), float(step))
        torch.testing.assert_close(fast.k, reference.k, rtol=0, atol=0)
        torch.testing.assert_close(fast.v, reference.v, rtol=0, atol=0)
        assert fast.positions() == reference.positions() == step + 1
        if step == 9:
            for c in (fast, reference):
                c.reorder(torch.tensor([2, 0, 0]))
            assert fast.extra["w"].shape == (3, 10)
    torch.testing.assert_close(fast.k, reference.k, rtol=0, atol=0)


def test_the_whole_buffer_is_finite_past_its_contents():
    """Under bf16 a step attends to the whole buffer with its empty slots masked; those slots must
    still hold numbers: a masked slot gets weight 0, and 0 * NaN is NaN. Memory just freed is full
    of NaN here, so an allocation that reuses it uninitialized shows."""
    fast, rows = FastKeyValueCache(), torch.arange(6)
    for step in range(20):  # capacity 16 -> 32; rows 6 -> 4 (gathered into a new buffer)
        torch.full((6, 2, 64, 8), float("nan")).sum()  # allocated, filled and freed
        x = torch.randn(rows.numel(), 2, 1, 8, dtype=torch.bfloat16)
        if step == 17:
            rows = torch.tensor([5, 0, 2, 2])
            torch.full((6, 2, 64, 8), float("nan")).sum()
            fast.reorder(rows)
            x = x[: rows.numel()]
        fast.append(x, x)
        k, _, mask = fast.whole()
        assert k.is_contiguous() and k.isfinite().all()
        filled = step + 1
        if filled < k.size(2):
            assert mask.flatten().tolist() == [True] * filled + [False] * (k.size(2) - filled)
        torch.testing.assert_close(k.narrow(2, 0, filled), fast.k, rtol=0, atol=0)
    assert k.size(2) == 32
