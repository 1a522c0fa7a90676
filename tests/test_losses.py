"""The chunked output layer and loss (transformer/fast/loss.py) against the reference: the full
logits, torch's cross-entropy and autograd."""

import pytest
import torch
import torch.nn.functional as F

from transformer.devices import cpu_has_bf16_matmul
from transformer.fast import accelerate
from transformer.fast import loss as chunked_loss
from transformer.fast.loss import projected_cross_entropy
from transformer.model import ModelConfig, Transformer
from transformer.training.objective import training_objective

pytestmark = pytest.mark.isa  # runs again under each instruction-set limit (tests/isa_matrix.py)


def padded_problem(dtype=torch.float64, vocab=13, d_model=6):
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, d_model, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, d_model, dtype=dtype, requires_grad=True)
    target = torch.randint(1, vocab, (3, 7))
    target[0, 4:], target[2, 1:] = 0, 0  # padding
    return hidden, weight, target


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 2 rows: 21 rows (11 of them padding) go through in 11 chunks, the last one short."""
    monkeypatch.setitem(chunked_loss.CHUNK_ELEMENTS, "cpu", 2 * 13)


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_projected_loss_and_gradients_are_those_of_the_full_logits(small_chunks, smoothing):
    hidden, weight, target = padded_problem()
    chunked = projected_cross_entropy(hidden, weight, target, 0, smoothing)
    grads = torch.autograd.grad(3.0 * chunked, (hidden, weight))  # backward scales by the incoming gradient
    logits = F.linear(hidden, weight).flatten(0, 1)  # in float64, unlike the trainer's fp32 reference
    reference = F.cross_entropy(logits, target.flatten(), ignore_index=0, label_smoothing=smoothing, reduction="sum")
    expected = torch.autograd.grad(3.0 * reference, (hidden, weight))
    torch.testing.assert_close(chunked, reference, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert grads[0][target == 0].abs().max() == 0  # padding positions get no gradient


def test_projected_loss_passes_gradcheck(small_chunks):
    hidden, weight, target = padded_problem()
    assert torch.autograd.gradcheck(lambda h, w: projected_cross_entropy(h, w, target, 0, 0.1), (hidden, weight))


@pytest.mark.parametrize("tie_output, output_bias", [(True, False), (False, False), (True, True)])
def test_model_with_projected_loss_gets_the_gradients_of_its_logits(small_chunks, tie_output, output_bias):
    """The tied embedding receives both its gradients, as embedding and as output projection (and
    a logits bias its own)."""
    cfg = ModelConfig(
        13,
        pad_id=0,
        n_encoder_layers=1,
        n_decoder_layers=2,
        d_model=8,
        n_heads=2,
        d_ff=16,
        dropout=0.0,
        tie_output=tie_output,
        output_bias=output_bias,
    )
    model = accelerate(Transformer(cfg)).double()
    if output_bias:
        torch.nn.init.normal_(model.logits_bias)
    _, _, target = padded_problem()
    src = torch.randint(1, 13, (3, 5))
    tgt_in = torch.cat([torch.full((3, 1), 1), target[:, :-1]], 1)
    grads = []
    for chunked in (True, False):
        out = model(src, tgt_in, project=not chunked)
        loss, objective = training_objective(
            out, target, 0, 0.1, 0.0, None, model.chunked_cross_entropy if chunked else None
        )
        objective.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad()
    (loss_a, grads_a), (loss_b, grads_b) = grads
    torch.testing.assert_close(loss_a, loss_b.double())  # the logits' loss is computed in fp32
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.skipif(not cpu_has_bf16_matmul(), reason="bf16 products need bf16 matrix instructions on CPU")
def test_projected_loss_in_bf16_stays_near_the_fp32_one():
    hidden, weight, target = padded_problem(torch.float32, vocab=500, d_model=64)
    bf16 = projected_cross_entropy(hidden, weight, target, 0, 0.1, torch.bfloat16)
    grads = torch.autograd.grad(bf16, (hidden, weight))
    fp32 = projected_cross_entropy(hidden, weight, target, 0, 0.1)
    expected = torch.autograd.grad(fp32, (hidden, weight))
    assert bf16.dtype == torch.float32 and grads[0].dtype == grads[1].dtype == torch.float32
    torch.testing.assert_close(bf16, fp32, rtol=2e-2, atol=0)
    for got, want in zip(grads, expected):
        assert (got - want).norm() < 0.05 * want.norm()


def test_projected_loss_in_fp32_matches_the_float64_one(small_chunks):
    """fp32 products on CPU take fast/linear.py's oneDNN path (when torch has oneDNN)."""
    hidden, weight, target = padded_problem()
    exact = projected_cross_entropy(hidden, weight, target, 0, 0.1)
    expected = torch.autograd.grad(exact, (hidden, weight))
    h32, w32 = (t.detach().float().requires_grad_() for t in (hidden, weight))
    fp32 = projected_cross_entropy(h32, w32, target, 0, 0.1)
    grads = torch.autograd.grad(fp32, (h32, w32))
    torch.testing.assert_close(fp32.double(), exact, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
