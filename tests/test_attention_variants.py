"""The attention variants and block options: each reduces exactly to standard attention at its
neutral setting, keeps causality and padding invariance, decodes the same with and without the
key/value cache, and composes as a config."""

import pytest
import torch

from transformer.decoding import DecodeConfig, Uncached, beam_search, greedy
from transformer.model import ModelConfig, Transformer, count_parameters
from transformer.model.attention import MultiHeadAttention
from transformer.model.attention_variants import (
    AttentionConfig,
    DCMHAttention,
    MoHAttention,
    OverlappingHeadsAttention,
    balance_loss,
)

from .conftest import BOS, EOS, make_model, random_tokens

VARIANTS = {
    "moh": {"attention": AttentionConfig(kind="moh", shared_heads=1, top_k=2)},
    "dcmha": {"attention": AttentionConfig(kind="dcmha", rank=2)},
    "overlap": {"attention": AttentionConfig(kind="overlap", overlap=2)},
    "modern": {"positional": "rope", "norm": "rmsnorm", "activation": "swiglu", "norm_first": True},
}


# --- Neutral settings reduce to standard multi-head attention ---------------------------------


def standard_and(variant: MultiHeadAttention) -> MultiHeadAttention:
    """A standard attention module holding the variant's W_q, W_k, W_v, W_o."""
    torch.manual_seed(1)
    standard = MultiHeadAttention(32, 4, variant.n_kv_heads, 0.0, True)
    standard.load_state_dict(variant.state_dict(), strict=False)
    return standard.eval()


def neutral_variants():
    torch.manual_seed(0)
    moh = MoHAttention(32, 4, 4, 0.0, True, shared_heads=4, top_k=1)
    with torch.no_grad():
        moh.router.weight.normal_()  # with every head shared, the router's values must not matter
    dcmha = DCMHAttention(32, 4, 2, 0.0, True, rank=2)
    with torch.no_grad():
        for p in list(dcmha.query_weights.parameters()) + list(dcmha.key_weights.parameters()):
            p.zero_()
    overlap = OverlappingHeadsAttention(32, 4, 4, 0.0, True, overlap=0)
    return {"moh_all_shared": moh, "dcmha_identity": dcmha, "overlap_0": overlap}


@pytest.mark.parametrize("name", ["moh_all_shared", "dcmha_identity", "overlap_0"])
def test_neutral_setting_equals_standard_attention(name):
    variant = neutral_variants()[name].eval()
    standard = standard_and(variant)
    query, source = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    keep = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    keep[1, ..., 5:] = False
    with torch.no_grad():
        out, weights = variant(query, source, keep, need_weights=True)
        expected, expected_weights = standard(query, source, keep, need_weights=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights, expected_weights)


def test_away_from_neutral_the_variants_differ_from_standard_attention():
    torch.manual_seed(0)
    variants = [
        MoHAttention(32, 4, 4, 0.0, True, shared_heads=1, top_k=2),
        DCMHAttention(32, 4, 4, 0.0, True, rank=2),
        OverlappingHeadsAttention(32, 4, 4, 0.0, True, overlap=2),
    ]
    query = torch.randn(2, 5, 32)
    for variant in variants:
        with torch.no_grad():
            for p in variant.parameters():
                p.add_(0.1 * torch.randn_like(p))
            if isinstance(variant, OverlappingHeadsAttention):
                continue  # W_o has another shape; compare by the overlap-0 slice instead below
            out, _ = variant.eval()(query, query, None)
            expected, _ = standard_and(variant)(query, query, None)
        assert not torch.allclose(out, expected, atol=1e-4)


def test_overlapping_heads_see_their_neighbours_features():
    attn = OverlappingHeadsAttention(32, 4, 4, 0.0, True, overlap=2)
    x = torch.arange(32.0).view(1, 1, 32)
    heads = attn.split_heads(x, 4)[0, :, 0]  # (heads, 8 + 2 * 2)
    assert heads.shape == (4, 12) and attn.w_o.in_features == 48
    assert heads[0].tolist() == [0, 0] + list(range(0, 10))  # zero beyond the first feature
    assert heads[1].tolist() == list(range(6, 18))
    assert heads[3].tolist() == list(range(22, 32)) + [0, 0]


# --- Mixture-of-Head routing and its balance loss ------------------------------------------------


def test_moh_activates_shared_plus_top_k_heads_per_token():
    torch.manual_seed(0)
    moh = MoHAttention(32, 4, 4, 0.0, True, shared_heads=1, top_k=2).train()
    with torch.no_grad():
        moh.router.weight.normal_()
    gates = moh.head_gates(torch.randn(3, 6, 32))
    active = (gates > 0).sum(-1)
    assert torch.all(active == 3) and moh.active_fraction == 0.75
    assert torch.all(gates[..., 0] > 0)  # the shared head, always
    assert moh.balance_loss is not None and moh.balance_loss.requires_grad


def test_balance_loss_is_minimal_for_uniform_routing():
    uniform = torch.full((50, 3), 1 / 3)
    chosen = torch.zeros(50, 3).scatter(-1, torch.arange(50)[:, None] % 3, 1.0)  # each head equally often
    assert balance_loss(uniform, chosen).item() == pytest.approx(1.0)
    torch.manual_seed(0)
    for _ in range(20):  # tokens that share a preference for some heads: imbalanced routing
        probs = (torch.randn(1, 3) + 0.1 * torch.randn(50, 3)).mul(3).softmax(-1)
        top = probs.topk(2, dim=-1).indices
        assert balance_loss(probs, torch.zeros_like(probs).scatter(-1, top, 1.0)) > 1.0


def test_moh_training_loss_includes_the_weighted_balance_loss():
    model = make_model(**VARIANTS["moh"]).train()
    src, tgt = random_tokens(2, 6), random_tokens(2, 5)
    model(src, tgt)
    aux = model.auxiliary_loss()
    layers = 2 + 2 * 2  # encoder self, decoder self and cross in each layer
    assert aux is not None and 0.01 * layers <= aux.item()
    assert model.auxiliary_loss() is None  # consumed
    assert make_model().train().auxiliary_loss() is None


# --- Properties every variant keeps: causality, padding and cached decoding are checked for
# every variant of VARIANTS in conftest.py by test_model.py; beam search here.


@pytest.mark.parametrize("variant", ["moh", "dcmha", "overlap", "modern"])
def test_variant_beam_search_matches_the_uncached_reference(variant):
    model, src = make_model(**VARIANTS[variant]), random_tokens(3, 6)
    cfg = DecodeConfig(beam_size=3, max_len_a=1.0, max_len_b=3)
    with torch.no_grad():
        cached = beam_search(model, src, BOS, EOS, cfg)
        uncached = beam_search(Uncached(model), src, BOS, EOS, cfg)
        assert [h[0].tokens for h in cached] == [h[0].tokens for h in uncached]
        one_beam = beam_search(model, src, BOS, EOS, DecodeConfig(beam_size=1, max_len_a=1.0, max_len_b=3))
        assert [h[0].tokens for h in one_beam] == greedy(model, src, BOS, EOS, cfg)


def test_swiglu_keeps_the_parameter_count_of_the_relu_network():
    relu = count_parameters(Transformer(ModelConfig(vocab_size=100, d_model=256, n_heads=4, d_ff=1024)))
    swiglu = count_parameters(Transformer(ModelConfig(vocab_size=100, d_model=256, n_heads=4, d_ff=1024, activation="swiglu")))  # fmt: skip
    assert abs(swiglu - relu) / relu < 0.01


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"attention": AttentionConfig(kind="mixture")}, "model.attention.kind"),
        ({"attention": AttentionConfig(kind="moh", shared_heads=1, top_k=4)}, "model.attention.top_k"),
        ({"attention": AttentionConfig(kind="dcmha", rank=3)}, "model.attention.rank"),
        ({"attention": AttentionConfig(kind="overlap", overlap=9)}, "model.attention.overlap"),
        ({"norm": "batchnorm"}, "model.norm"),
        ({"activation": "tanh"}, "model.activation"),
    ],
)
def test_bad_variant_config_names_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig(vocab_size=40, d_model=32, n_heads=4, **overrides)


def test_checkpoint_config_dict_round_trips():
    from dataclasses import asdict

    cfg = ModelConfig(vocab_size=40, d_model=32, n_heads=4, attention=AttentionConfig(kind="moh"))
    assert ModelConfig(**asdict(cfg)) == cfg
