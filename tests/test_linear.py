"""The oneDNN path of linear layers (transformer/linear.py) computes what F.linear computes."""

import copy

import pytest
import torch
import torch.nn.functional as F

from transformer.linear import Linear, linear, onednn_enabled, set_onednn
from transformer.model import ModelConfig, Transformer

pytestmark = pytest.mark.skipif(not onednn_enabled(), reason="oneDNN path off or unavailable")


@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_f_linear(bias):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 24).transpose(0, 1).requires_grad_()  # non-contiguous, 3-d
    weight = torch.randn(40, 24, requires_grad=True)
    b = torch.randn(40, requires_grad=True) if bias else None
    grad = torch.randn(7, 3, 40)
    ours = linear(x, weight, b)
    assert type(ours.grad_fn).__name__ == "_OneDNNLinearBackward"  # the oneDNN path, not F.linear
    ours.backward(grad)
    got = [t.grad.clone() for t in (x, weight, b) if t is not None]
    for t in (x, weight, b):
        if t is not None:
            t.grad = None
    reference = F.linear(x, weight, b)
    reference.backward(grad)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    for g, t in zip(got, [t for t in (x, weight, b) if t is not None]):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-4)


def test_the_packed_inference_weight_follows_every_change_of_the_weight():
    layer = Linear(16, 8)
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        first = layer.packed.packed
        assert first is not None and first.is_mkldnn
        layer.weight.mul_(-2.0)  # in place, as an optimizer step does
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert layer.packed.packed is not first
        layer.load_state_dict({"weight": torch.randn(8, 16), "bias": torch.zeros(8)})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    clone = copy.deepcopy(layer)  # copies start without the packed tensor
    with torch.no_grad():
        torch.testing.assert_close(clone(x), layer(x))


def test_a_model_trains_and_decodes_the_same_with_and_without_onednn():
    cfg = ModelConfig(vocab_size=50, n_encoder_layers=2, n_decoder_layers=2, d_model=32, n_heads=4, d_ff=64, dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg)
    src, tgt = torch.randint(4, 50, (3, 9)), torch.randint(4, 50, (3, 6))
    results = []
    previous = onednn_enabled()
    try:
        for enabled in (False, True):
            set_onednn(enabled)
            model.zero_grad()
            logits = model(src, tgt)
            logits.square().mean().backward()
            with torch.no_grad():
                inference = model(src, tgt)
            results.append((logits.detach(), inference, [p.grad.clone() for p in model.parameters()]))
    finally:
        set_onednn(previous)
    (blas, blas_inf, blas_grads), (ours, ours_inf, our_grads) = results
    torch.testing.assert_close(ours, blas, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours_inf, blas_inf, rtol=1e-4, atol=1e-5)
    for a, b in zip(our_grads, blas_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_bf16_autocast_keeps_torchs_own_path():
    layer, x = Linear(16, 8), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
