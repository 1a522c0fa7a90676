"""Converting a trained MHA model to GQA: no-op at n_kv_heads = n_heads, function-preserving head
alignment, and lossless merging of heads that are copies of each other."""

import pytest
import torch

from transformer.interop.gqa import align_heads, convert_to_gqa, kv_cache_bytes_per_token, merge_heads
from transformer.model.attention import MultiHeadAttention

from .conftest import make_model


def batches(n: int = 2):
    torch.manual_seed(1)
    return [(torch.randint(4, 40, (3, 7)), torch.randint(4, 40, (3, 6))) for _ in range(n)]


@pytest.mark.parametrize("calibrate", [False, True])
def test_converting_to_as_many_kv_heads_changes_no_output(calibrate):
    model = make_model()
    converted = convert_to_gqa(model, 4, batches() if calibrate else None)
    src, tgt = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(converted(src, tgt), model(src, tgt))
    assert converted.cfg.kv_heads == 4


@pytest.mark.parametrize("rotate_keys", [True, False])
def test_aligning_heads_changes_no_output(rotate_keys):
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, 4, 0.0, True).eval()
    query, source = torch.randn(2, 5, 32), torch.randn(2, 6, 32)
    with torch.no_grad():
        before, _ = attn(query, source, None)
        align_heads(attn, source.flatten(0, 1), group_size=2, rotate_keys=rotate_keys)
        after, _ = attn(query, source, None)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


def test_alignment_groups_copied_heads_so_merging_them_is_lossless():
    """Heads 0 and 2 (and 1 and 3) have the same keys and values up to a rotation: alignment
    must group them and undo the rotation, and then mean pooling loses nothing."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, 4, 0.0, False).eval()
    rotation = torch.linalg.qr(torch.randn(8, 8))[0]
    with torch.no_grad():
        for w in (attn.w_k.weight, attn.w_v.weight):
            heads = w.view(4, 8, 32)
            heads[2], heads[3] = rotation.T @ heads[0], heads[1].clone()
        attn.w_q.weight.view(4, 8, 32)[2] = rotation.T @ attn.w_q.weight.view(4, 8, 32)[2]
    query, source = torch.randn(2, 5, 32), torch.randn(2, 6, 32)
    with torch.no_grad():
        before, _ = attn(query, source, None)
        align_heads(attn, torch.randn(200, 32), group_size=2, rotate_keys=True)
        merge_heads(attn, 2)
        after, _ = attn(query, source, None)
    assert attn.w_k.out_features == 16 and attn.n_kv_heads == 2
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_plain_merging_of_different_heads_changes_outputs_and_shrinks_the_cache():
    model = make_model()
    converted = convert_to_gqa(model, 1)
    src, tgt = batches(1)[0]
    with torch.no_grad():
        assert not torch.allclose(converted(src, tgt), model(src, tgt))
    assert (
        kv_cache_bytes_per_token(converted.cfg)["self_per_target_token"] * 4
        == (kv_cache_bytes_per_token(model.cfg)["self_per_target_token"])
    )


def test_conversion_refuses_models_it_cannot_convert():
    with pytest.raises(ValueError, match="must divide"):
        convert_to_gqa(make_model(), 3)
    with pytest.raises(ValueError, match="already uses 2"):
        convert_to_gqa(make_model(n_kv_heads=2), 1)
