"""Every fast path against the reference it replaces (transformer/fast/ against transformer/model/transformer.py,
attention.py, blocks.py): kernels, caches, folded beams, grouped encoding, and whole models trained
and decoded under both runtimes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer.decoding import DecodeConfig, beam_search, greedy
from transformer.fast import accelerate, fast_class
from transformer.fast.attention import FastMultiHeadAttention, fast_attention, product_attention
from transformer.fast.encoding import length_groups
from transformer.fast.model import FastRotary, FastTransformer
from transformer.model import Transformer, attention_variants, padding_mask
from transformer.model.attention import MultiHeadAttention, Rotary, scaled_dot_product_attention
from transformer.model.attention_variants import AttentionConfig
from transformer.runtime import RuntimeConfig

from .conftest import BOS, CONDITIONED_NOISE, EOS, PAD, RUNTIMES, VARIANTS, make_model, random_tokens, variant_id

pytestmark = pytest.mark.isa  # runs again under each instruction-set limit (tests/isa_matrix.py)


def test_accelerate_keeps_the_parameters_and_the_state_dict():
    plain = make_model()
    state = {name: t.clone() for name, t in plain.state_dict().items()}
    fast = accelerate(plain)
    assert isinstance(fast, FastTransformer)
    assert state.keys() == fast.state_dict().keys()
    assert all(torch.equal(state[name], t) for name, t in fast.state_dict().items())
    assert accelerate(make_model(), RuntimeConfig(fast=False)).__class__ is Transformer


def training_step(model: Transformer) -> dict[str, torch.Tensor]:
    """The loss and every parameter's gradient for one training batch (no dropout), by name."""
    src, tgt = random_tokens(3, 7), random_tokens(3, 6)
    src[2, 5:] = PAD
    loss = F.cross_entropy(model.train()(src, tgt).flatten(0, 1), tgt.flatten(), label_smoothing=0.1)
    loss.backward()
    return {"loss": loss.detach(), **{name: p.grad.clone() for name, p in model.named_parameters()}}


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_fast_training_step_equals_the_reference(variant):
    """Loss and gradients of a training batch agree between the runtimes. Each tensor is compared
    by its norm with the reference in float64: the fast one may be off by four times the reference's
    own fp32 error (its sensitivity to rounding, which a kernel that sums in another order, as
    oneDNN's do by CPU, shares), plus 1e-5 of the tensor's norm and 1e-7 of all gradients' norm
    (rounding, for the key biases, whose true gradient is zero). Any one bias gradient off by 0.01%
    fails it in every variant; the fast path uses at most a quarter of the bound (native, AVX2)."""
    exact = training_step(make_model("reference", CONDITIONED_NOISE, **variant).double())
    reference, fast = (training_step(make_model(runtime, CONDITIONED_NOISE, **variant)) for runtime in RUNTIMES)
    scale = torch.cat([exact[name].flatten() for name in exact if name != "loss"]).norm()
    for name, truth in exact.items():
        own_error = (reference[name].double() - truth).norm()
        error = (fast[name].double() - truth).norm()
        bound = 4 * own_error + 1e-5 * truth.norm() + 1e-7 * scale
        assert error <= bound, f"{name}: off by {error:.2e} > {bound:.2e} (its norm {truth.norm():.2e})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rotary_positions_as_complex_products_equal_the_reference(dtype):
    """Also on views whose pairs do not start at even offsets (one feature sliced off the front)."""
    reference, fast = Rotary(8, 64), Rotary(8, 64)
    fast.__class__ = FastRotary
    for start in (0, 1):
        base = torch.randn(2, 11, 3, 9, dtype=torch.float64).to(dtype)
        x = base[..., start : start + 8].transpose(1, 2).requires_grad_()  # (batch, heads, len, d_head), strided
        outputs, grads = [], []
        for rotary in (reference, fast):
            y = rotary(x, offset=5)
            (grad,) = torch.autograd.grad(y, x, torch.arange(y.numel(), dtype=dtype).view_as(y) % 7)
            outputs.append(y), grads.append(grad)
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_fast_decoding_equals_the_reference(variant):
    """Greedy and beam search (folded beams, growing caches, grouped encoding) find the same
    translations and scores under both runtimes."""
    src = random_tokens(5, 9)
    src[3:, 6:] = PAD
    cfg = DecodeConfig(beam_size=3, max_len_a=1.0, max_len_b=4)
    out = {}
    for runtime in ("reference", "fast"):
        model = make_model(runtime, **variant).double()
        with torch.no_grad():
            out[runtime] = (greedy(model, src, BOS, EOS, cfg), beam_search(model, src, BOS, EOS, cfg))
    assert out["fast"][0] == out["reference"][0]
    for fast, ref in zip(out["fast"][1], out["reference"][1]):
        assert [h.tokens for h in fast] == [h.tokens for h in ref]
        assert [h.score for h in fast] == pytest.approx([h.score for h in ref], abs=1e-9)


def test_cross_attention_caches_its_keys_and_values_contiguous():
    """The source-side keys and values are made contiguous once, when they are cached: as views
    of the projections, every later step's batched products would copy them again."""
    model = make_model("fast")
    src = random_tokens(3, 7)
    src_mask = padding_mask(src, PAD)
    with torch.no_grad():
        memory = model.encode(src, src_mask)[0]
        state = model.new_state()
        model.decode(torch.full((3, 1), BOS), memory, src_mask, state)
    for layer in state.layers:
        assert layer.cross.k.is_contiguous() and layer.cross.v.is_contiguous()


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_bf16_attention_on_cpu_agrees_with_fp32_with_and_without_gradients(grad):
    """bf16 on CPU takes the batched products, for decoding (one query here) and for training;
    both must give the fp32 result to bf16 precision, masks included."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, n, 16) for n in (1, 9, 9))
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 6:] = False
    expected = fast_attention(q, k, v, mask, 0.0)
    q16, k16, v16 = (x.bfloat16().requires_grad_(grad) for x in (q, k, v))
    with torch.set_grad_enabled(grad):
        out = fast_attention(q16, k16, v16, mask, 0.0)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    if grad:
        out.float().sum().backward()
        assert q16.grad is not None and k16.grad[1, :, 6:].abs().max() == 0  # masked keys get no gradient


@pytest.mark.parametrize("kv_heads, q_len, mask_rows", [(4, 1, 1), (2, 3, 1), (1, 5, 5), (4, 7, 7), (2, 4, 0)], ids=str)
def test_product_attention_equals_the_fused_kernel(kv_heads, q_len, mask_rows):
    """The decoding-step route (two batched products) computes what scaled_dot_product_attention
    does, for MHA and grouped-query heads, with padding masks, causal-shaped masks and none."""
    torch.manual_seed(0)
    q = torch.randn(3, 4, q_len, 8, dtype=torch.float64)
    k, v = torch.randn(2, 3, kv_heads, 9, 8, dtype=torch.float64).unbind(0)
    mask = None
    if mask_rows:
        mask = torch.rand(3, 1, mask_rows, 9) > 0.4
        mask[..., 0] = True  # every query keeps a key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != 4)
    torch.testing.assert_close(product_attention(q, k, v, mask), expected, rtol=1e-12, atol=1e-12)


def test_product_attention_drops_weights_like_the_explicit_path():
    """With attention dropout (training), the products drop the same weights as the explicit
    softmax-dropout-matmul path from the same seed, and gradients reach q, k and v."""
    q, k, v = (torch.randn(2, 4, n, 8, dtype=torch.float64, requires_grad=True) for n in (5, 7, 7))
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[..., 0] = True
    torch.manual_seed(3)
    out = product_attention(q, k, v, mask, dropout_p=0.5)
    torch.manual_seed(3)
    expected, _ = scaled_dot_product_attention(q, k, v, mask, dropout_p=0.5)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out, product_attention(q, k, v, mask))  # something was dropped
    out.sum().backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k, v))


def test_cross_attention_of_grouped_beams_equals_attention_to_repeated_memory():
    """Beam search folds a sentence's k rows into one query against one row of memory; outputs
    and weights must be those of k rows attending to k copies of the memory."""
    model = make_model("fast")
    layer = model.decoder_layers[0]
    torch.manual_seed(0)
    memory, query = torch.randn(2, 6, 32), torch.randn(6, 4, 32)  # 2 sentences x 3 beams, 4 target positions
    src_mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    src_mask[1, ..., 4:] = False
    with torch.no_grad():
        out, weights = layer.attend_memory(query, memory, src_mask, None, need_weights=True)
        reference, ref_weights = layer.cross_attn(
            query, memory.repeat_interleave(3, 0), src_mask.repeat_interleave(3, 0), None, True, True
        )
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(weights, ref_weights)


def test_length_groups_hold_every_row_once_with_all_of_its_tokens():
    torch.manual_seed(0)
    lengths = torch.randint(1, 41, (64,))
    real = torch.arange(40)[None, :] < lengths[:, None]
    groups = length_groups(real, min_tokens=64)
    rows = torch.cat([r for r, _ in groups])
    assert sorted(rows.tolist()) == list(range(64))
    for r, length in groups:
        assert int(lengths[r].max()) == length
    assert 1 < len(groups) < 64
    padded = sum(len(r) * length for r, length in groups)
    assert padded < 0.75 * 64 * 40  # most of the padding is gone
    assert len(length_groups(real, min_tokens=10**6)) == 1  # small batches stay whole


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_encoding_in_length_groups_equals_encoding_the_padded_batch(variant):
    """Grouped, the encoder's products have fewer rows than padded. By default an inference
    product runs on packed oneDNN or on BLAS by its rows (fast/linear.py: by_rows), so the two
    could run on different libraries, whose fp32 roundings DCMHA's scores here (scaled 40-85x,
    conftest.VARIANT_NOISE) amplify to 1e-4 under AVX2. The grouping is what is compared, so both
    run on the same library: runtime.onednn_linear=true."""
    model = accelerate(make_model("reference", **variant), RuntimeConfig(onednn_linear=True))
    torch.manual_seed(1)
    lengths = torch.randint(1, 33, (24,))
    src = random_tokens(24, 32).masked_fill(torch.arange(32)[None, :] >= lengths[:, None], PAD)
    mask = padding_mask(src, PAD)
    assert len(length_groups(mask.flatten(1))) > 1
    with torch.no_grad():
        grouped, padded = model.encode(src, mask)[0], Transformer.encode(model, src, mask)[0]
    real = mask.flatten(1)
    torch.testing.assert_close(grouped[real], padded[real], atol=1e-5, rtol=1e-4)


class TemperedKeysAttention(MultiHeadAttention):
    """A variant as docs/EXTENDING.md describes one, overriding `keys_values`: keys scaled by a
    learned temperature per key/value head before they are cached."""

    def __init__(self, d_model, n_heads, n_kv_heads, dropout, bias, rotary=None):
        super().__init__(d_model, n_heads, n_kv_heads, dropout, bias, rotary)
        self.temperature = nn.Parameter(torch.linspace(0.5, 2.0, n_kv_heads))

    def keys_values(self, k, v, cache, static_kv, offset=0):
        if k is not None:
            k = k * self.temperature.repeat_interleave(self.d_head).to(k.dtype)
        return super().keys_values(k, v, cache, static_kv, offset)


@pytest.fixture
def tempered(monkeypatch) -> dict:
    monkeypatch.setitem(attention_variants.VARIANTS, "tempered", attention_variants.Variant(TemperedKeysAttention))
    return {"attention": AttentionConfig(kind="tempered")}


def test_the_fast_runtime_keeps_the_steps_a_variant_overrides(tempered, caplog):
    """The variant's own keys_values stays (the fast attend is added), under its own visible name,
    and the model trains and decodes as the reference does."""
    with caplog.at_level("INFO", logger="transformer.fast"):
        model = make_model("fast", **tempered)
    attention = model.encoder_layers[0].self_attn
    assert type(attention).__name__ == "FastTemperedKeysAttention"
    assert type(attention).keys_values is TemperedKeysAttention.keys_values
    assert type(attention).attend is FastMultiHeadAttention.attend
    assert fast_class(TemperedKeysAttention)[1] == []  # caching is the cache object's: nothing to keep
    assert fast_class(attention_variants.DCMHAttention)[1] == ["attend"]  # its own attend is kept
    test_fast_training_step_equals_the_reference(tempered)
    test_fast_decoding_equals_the_reference(tempered)
