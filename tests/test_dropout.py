"""transformer.fast.dropout: the CPU mask drawn four elements to a random word; and word dropout (blocks.py)."""

import pytest
import torch

from transformer.fast.dropout import FastDropout, dropout, keep_mask
from transformer.model.blocks import word_dropout

CPU = torch.device("cpu")


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_mask_keeps_one_minus_p_with_independent_neighbours(p):
    torch.manual_seed(0)
    mask, keep = keep_mask(torch.Size([4, 250_001]), p, CPU)  # not a multiple of four elements
    assert mask.shape == (4, 250_001) and mask.dtype == torch.bool
    assert keep == pytest.approx(1 - p, abs=2**-16)
    assert mask.float().mean().item() == pytest.approx(keep, abs=0.003)  # 6 standard deviations
    flat = mask.flatten()[:1_000_000].float().view(-1, 4)  # the four quarters of each word
    for i in range(4):
        for j in range(i + 1, 4):
            both = (flat[:, i] * flat[:, j]).mean().item()
            assert both == pytest.approx(keep * keep, abs=0.004)  # independent: P(both kept) = keep^2


def test_dropout_is_unbiased_and_its_gradient_uses_the_same_mask():
    torch.manual_seed(1)
    x = torch.randn(300, 300, requires_grad=True)
    y = dropout(x, 0.3)
    kept = y != 0
    assert torch.allclose(y[kept], x[kept] / 0.7, rtol=1e-4)
    assert dropout(torch.ones(1000, 1000), 0.3).mean().item() == pytest.approx(1.0, abs=0.005)
    y.backward(torch.full_like(y, 2.0))
    assert torch.equal(x.grad != 0, kept) and torch.allclose(x.grad[kept], torch.tensor(2.0 / 0.7))


def test_masks_repeat_with_the_seed_and_differ_without():
    x = torch.randn(64, 64)
    torch.manual_seed(5)
    first, second = dropout(x, 0.3), dropout(x, 0.3)
    torch.manual_seed(5)
    assert torch.equal(dropout(x, 0.3), first) and not torch.equal(first, second)


def test_module_modes_and_edge_probabilities():
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    layer = FastDropout(0.3)
    assert layer(x).dtype == torch.bfloat16 and "p=0.3" in repr(layer)
    assert layer.eval()(x) is x and dropout(x, 0.0) is x and dropout(x, 1e-6) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    with pytest.raises(ValueError, match="between 0 and 1"):
        FastDropout(1.5)


def test_word_dropout_zeroes_whole_token_vectors_without_bias():
    torch.manual_seed(2)
    x = torch.randn(64, 50, 16, requires_grad=True)
    y = word_dropout(x, 0.25)
    dropped = (y == 0).all(-1)  # (batch, length): whole vectors, never single features
    assert torch.equal((y == 0).any(-1), dropped)
    assert dropped.float().mean().item() == pytest.approx(0.25, abs=0.03)  # 3,200 tokens: 4 s.d.
    assert torch.allclose(y[~dropped], x[~dropped] / 0.75)
    y.sum().backward()
    assert torch.equal((x.grad == 0).all(-1), dropped)
    assert word_dropout(x, 0.25, training=False) is x and word_dropout(x, 0.0) is x
