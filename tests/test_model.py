"""Properties of the model: causality, padding invariance, agreement with torch's reference
attention, head layouts (MHA/GQA/MQA), attention weights, and cached == uncached decoding; each
under both runtimes, the reference model as written and with the fast paths installed."""

import pytest
import torch
from torch import nn

from transformer.decoding import DecodeConfig, greedy
from transformer.fast import install
from transformer.model import ModelConfig, Transformer, causal_mask, padding_mask
from transformer.model.attention import MultiHeadAttention
from transformer.runtime import RuntimeConfig

from .conftest import BOS, EOS, PAD, RUNTIMES, VARIANTS, make_model, random_tokens, variant_id

pytestmark = pytest.mark.isa  # runs again under each instruction-set limit (tests/isa_matrix.py)


def attention_module(runtime: str, **kwargs) -> MultiHeadAttention:
    attn = MultiHeadAttention(**kwargs).eval()
    if runtime == "fast":
        install(attn, RuntimeConfig())
    return attn


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_decoder_is_causal(variant, runtime):
    """Changing a future target token never changes the logits at earlier positions."""
    model, src, tgt = make_model(runtime, **variant), random_tokens(2, 7), random_tokens(2, 9)
    changed = tgt.clone()
    changed[:, 5:] = random_tokens(2, 4)
    with torch.no_grad():
        before, after = model(src, tgt), model(src, changed)
    torch.testing.assert_close(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5:], after[:, 5:])


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_padding_does_not_change_outputs(variant, runtime):
    """A sentence padded inside a batch gets the same logits as the sentence alone. In float64, as
    padding reorders the sums of the batched products: in fp32 DCMHA's head composition amplifies
    that rounding (to 6.5e-4 under AVX2; 2e-13 in float64), which would hide a small leak."""
    model, src, tgt = make_model(runtime, **variant).double(), random_tokens(1, 6), random_tokens(1, 5)
    padded_src = torch.cat([src, torch.full((1, 4), PAD)], dim=1)
    with torch.no_grad():
        alone = model(src, tgt)
        padded = model(padded_src, tgt)
        batched = model(torch.cat([padded_src, random_tokens(1, 10)]), torch.cat([tgt, random_tokens(1, 5)]))
    torch.testing.assert_close(alone, padded, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(alone, batched[:1], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_multi_head_attention_matches_torch_reference(runtime):
    """Our attention with W_q, W_k, W_v, W_o copied into torch.nn.MultiheadAttention agrees with it."""
    torch.manual_seed(0)
    ours = attention_module(runtime, d_model=32, n_heads=4, n_kv_heads=4, dropout=0.0, bias=True)
    ref = nn.MultiheadAttention(32, 4, bias=True, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.w_q.weight, ours.w_k.weight, ours.w_v.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.w_q.bias, ours.w_k.bias, ours.w_v.bias]))
        ref.out_proj.weight.copy_(ours.w_o.weight)
        ref.out_proj.bias.copy_(ours.w_o.bias)
    query, source = torch.randn(3, 5, 32), torch.randn(3, 7, 32)
    keep = torch.ones(3, 7, dtype=torch.bool)
    keep[1, 4:] = False
    with torch.no_grad():
        out, weights = ours(query, source, keep[:, None, None, :], need_weights=True)
        fast, _ = ours(query, source, keep[:, None, None, :])
        expected, expected_weights = ref(query, source, source, key_padding_mask=~keep, average_attn_weights=False)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(fast, expected)
    torch.testing.assert_close(weights, expected_weights)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_head_layouts_shapes_and_paths_agree(n_kv_heads, runtime):
    """MHA, GQA and MQA: projection sizes, output shapes, and the fused kernel == the explicit path."""
    attn = attention_module(runtime, d_model=32, n_heads=4, n_kv_heads=n_kv_heads, dropout=0.0, bias=True)
    assert attn.w_k.out_features == attn.w_v.out_features == n_kv_heads * 8
    query, mask = torch.randn(2, 5, 32), causal_mask(5)
    with torch.no_grad():
        out, weights = attn(query, query, mask, need_weights=True)
        fast, none = attn(query, query, mask)
    assert out.shape == (2, 5, 32) and weights.shape == (2, 4, 5, 5) and none is None
    torch.testing.assert_close(out, fast)


def test_attention_weights_are_distributions_that_respect_masks():
    model, src, tgt = make_model(), random_tokens(2, 6), random_tokens(2, 5)
    src[1, 4:] = PAD
    with torch.no_grad():
        weights = model.attention_weights(src, tgt)
    assert len(weights["encoder_self"]) == len(weights["decoder_self"]) == len(weights["cross"]) == 2
    for layers in weights.values():
        for w in layers:
            torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
    for w in weights["encoder_self"] + weights["cross"]:
        assert torch.all(w[1, :, :, 4:] == 0)  # padding keys get no weight
    for w in weights["decoder_self"]:
        assert torch.all(w.triu(diagonal=1) == 0)  # no query sees a later target position


def test_masks_follow_the_true_means_may_attend_convention():
    tokens = torch.tensor([[5, 6, PAD]])
    assert padding_mask(tokens, PAD).tolist() == [[[[True, True, False]]]]
    assert causal_mask(2, offset=1)[0, 0].tolist() == [[True, True, False], [True, True, True]]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_incremental_decoding_equals_full_recomputation(variant, runtime):
    """Logits from the KV cache, one token at a time, equal a full forward pass over the prefix.
    In float64, so that the comparison is tight and no variant's fp32 rounding (DCMHA's head
    composition amplifies it on some CPUs) can hide a real difference or fail a correct cache."""
    model, src, tgt = make_model(runtime, **variant).double(), random_tokens(3, 6), random_tokens(3, 7)
    src_mask = padding_mask(src, PAD)
    with torch.no_grad():
        full = model(src, tgt)
        memory, _ = model.encode(src, src_mask)
        state = model.new_state()
        steps = [model.decode(tgt[:, i : i + 1], memory, src_mask, state)[0] for i in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-10)
    n_kv = model.cfg.kv_heads
    assert state.layers[0].self.k.shape == (3, n_kv, 7, model.cfg.head_size)  # shrinks with n_kv_heads


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_greedy_matches_argmax_of_uncached_recomputation(runtime):
    model, src = make_model(runtime), random_tokens(4, 6)
    cfg = DecodeConfig(max_len_a=1.0, max_len_b=4)
    with torch.no_grad():
        hyps = greedy(model, src, BOS, EOS, cfg)
        for row, hyp in enumerate(hyps):
            tokens = torch.tensor([[BOS]])
            for _ in range(6 + 4 - 1):  # max_len_a * src_len + max_len_b tokens, the last one EOS
                next_token = model(src[row : row + 1], tokens)[0, -1].argmax()
                if next_token == EOS:
                    break
                tokens = torch.cat([tokens, next_token.view(1, 1)], dim=1)
            assert hyp == tokens[0, 1:].tolist()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_decoder_state_reorder_selects_batch_rows(runtime):
    model, src = make_model(runtime), random_tokens(3, 5)
    src_mask = padding_mask(src, PAD)
    with torch.no_grad():
        memory, _ = model.encode(src, src_mask)
        state = model.new_state()
        model.decode(torch.full((3, 1), BOS), memory, src_mask, state)
        k = state.layers[0].self.k.clone()
        state.reorder(torch.tensor([2, 2, 0]))
    torch.testing.assert_close(state.layers[0].self.k, k[[2, 2, 0]])


def test_base_preset_is_the_paper_model():
    model = Transformer(ModelConfig(vocab_size=8000))
    assert len(model.encoder_layers) == len(model.decoder_layers) == 6
    # Embedding shared by both sides and the output projection, plus 6 encoder and 6 decoder layers.
    d, ff = 512, 2048
    attn = 4 * (d * d + d)
    enc_layer = attn + (d * ff + ff + ff * d + d) + 2 * 2 * d
    dec_layer = 2 * attn + (d * ff + ff + ff * d + d) + 3 * 2 * d
    assert sum(p.numel() for p in model.parameters()) == 8000 * d + 6 * enc_layer + 6 * dec_layer


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"d_model": 30, "n_heads": 4}, "model.d_model"),
        ({"n_kv_heads": 3}, "model.n_kv_heads"),
        ({"positional": "alibi"}, "model.positional"),
        ({"word_dropout": 1.0}, "model.word_dropout"),
        ({"dropout": -0.1}, "model.dropout"),
        ({"attention_dropout": 1.5}, "model.attention_dropout"),
        ({"activation_dropout": 1.0}, "model.activation_dropout"),
    ],
)
def test_bad_model_config_names_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig(**overrides)


def test_word_dropout_acts_in_training_only_and_keeps_the_decoder_causal():
    model, src, tgt = make_model(word_dropout=0.3), random_tokens(3, 7), random_tokens(3, 6)
    plain = make_model()  # the same weights (same seed) without word dropout
    with torch.no_grad():
        assert torch.equal(model(src, tgt), plain(src, tgt))  # eval: no tokens dropped
        model.train()
        torch.manual_seed(3)
        noisy = model(src, tgt)
        assert not torch.allclose(noisy, plain(src, tgt))
        changed = tgt.clone()
        changed[:, 4:] = random_tokens(3, 2)
        torch.manual_seed(3)  # the same tokens dropped: only the changed positions may differ
        assert torch.equal(model(src, changed)[:, :4], noisy[:, :4])


def test_head_mask_of_ones_changes_nothing_and_keeping_one_head_changes_outputs():
    model, src, tgt = make_model(), random_tokens(2, 6), random_tokens(2, 5)
    with torch.no_grad():
        plain = model(src, tgt)
        model.set_head_mask({kind: torch.ones(2, 4) for kind in ("encoder_self", "decoder_self", "cross")})
        ones = model(src, tgt)
        only_head_0 = torch.zeros(2, 4)
        only_head_0[:, 0] = 1.0
        model.set_head_mask({"encoder_self": only_head_0})
        pruned = model(src, tgt)
        model.set_head_mask(None)
        restored = model(src, tgt)
    torch.testing.assert_close(ones, plain, rtol=0, atol=0)
    assert not torch.allclose(pruned, plain)
    torch.testing.assert_close(restored, plain, rtol=0, atol=0)
