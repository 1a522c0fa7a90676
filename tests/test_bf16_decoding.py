"""bf16 decoding on CPU: the steps read the self-attention cache's whole buffer and keep
cross-attention in fp32 (transformer/fast/attention.py); both must agree with the plain
computation to bf16 precision, for every model variant, under both runtimes."""

import pytest
import torch

from transformer.fast.cache import FastKeyValueCache
from transformer.model import padding_mask

from .conftest import PAD, RUNTIMES, VARIANTS, make_model, random_tokens, variant_id

pytestmark = pytest.mark.isa  # runs again under each instruction-set limit (tests/isa_matrix.py)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_bf16_incremental_decoding_agrees_with_full_recomputation(variant, runtime):
    """Logits from the cache, one token at a time, equal a full forward pass over the prefix
    under CPU bf16 autocast, to bf16 precision, for every variant."""
    model, src, tgt = make_model(runtime, **variant), random_tokens(3, 6), random_tokens(3, 18)
    src_mask = padding_mask(src, PAD)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(src, tgt).float()
        memory, _ = model.encode(src, src_mask)
        state = model.new_state()
        steps = [model.decode(tgt[:, i : i + 1], memory, src_mask, state)[0].float() for i in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
def test_bf16_decoding_reads_the_whole_cache_buffer_with_the_same_result(n_kv_heads, monkeypatch):
    """bf16 decoding steps on CPU attend over the self-attention cache's whole buffer, its empty
    slots masked (FastKeyValueCache.whole). Each step's logits must match those from the cached
    tokens alone, before and after the buffer grows (16 -> 32 slots) and after a reorder."""
    model, src = make_model("fast", n_kv_heads=n_kv_heads), random_tokens(3, 5)
    src_mask = padding_mask(src, PAD)
    tgt = random_tokens(3, 20)
    key_lengths, whole = [], FastKeyValueCache.whole

    def spy(cache):
        k, v, mask = whole(cache)
        key_lengths.append(k.size(2))
        return k, v, mask

    def narrowed(cache):
        return cache.k, cache.v, None

    def steps(whole: bool) -> list[torch.Tensor]:
        with monkeypatch.context() as patch, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            patch.setattr(FastKeyValueCache, "whole", spy if whole else narrowed)
            mask, rows = src_mask, torch.arange(3)
            memory, _ = model.encode(src, mask)
            state, logits = model.new_state(), []
            for i in range(tgt.size(1)):
                logits.append(model.decode(tgt[rows, i : i + 1], memory, mask, state)[0].float())
                if i == 9:  # keep rows 2, 0, 0, as beam search or pruning would
                    rows = torch.tensor([2, 0, 0])
                    state.reorder(rows)
                    memory, mask = memory[rows], mask[rows]
        return logits

    whole_buffer, narrowed_view = steps(True), steps(False)
    assert key_lengths[0] == 16 and key_lengths[-1] == 32  # the whole buffer, not the tokens so far
    for a, b in zip(whole_buffer, narrowed_view):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_bf16_decoding_keeps_cross_attention_keys_and_values_in_fp32():
    """Under bf16 autocast on CPU the cross-attention cache is fp32 and its products run in fp32
    (runtime.fp32_cross); the logits agree with bf16 cross-attention to bf16 precision. A model
    cast to bf16 (no autocast) decodes through the same path and gets bf16 logits."""
    model, src, tgt = make_model("fast"), random_tokens(3, 5), random_tokens(3, 6)
    src_mask = padding_mask(src, PAD)

    def decode(model, autocast: bool):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            memory, _ = model.encode(src, src_mask)
            state = model.new_state()
            steps = [model.decode(tgt[:, i : i + 1], memory, src_mask, state)[0] for i in range(tgt.size(1))]
        return torch.cat(steps, dim=1), state

    logits, state = decode(model, True)
    assert state.layers[0].cross.k.dtype == state.layers[0].cross.v.dtype == torch.float32
    assert state.layers[0].self.k.dtype == torch.bfloat16
    for module in model.modules():
        if hasattr(module, "fp32_cross"):
            module.fp32_cross = False
    bf16_cross, state = decode(model, True)
    assert state.layers[0].cross.k.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), bf16_cross.float(), rtol=2e-2, atol=2e-2)
    pure, state = decode(make_model("fast").bfloat16(), False)
    assert pure.dtype == torch.bfloat16 and state.layers[0].cross.k.dtype == torch.float32
    torch.testing.assert_close(pure.float(), bf16_cross.float(), rtol=0.1, atol=0.1)
