"""The oneDNN path of linear layers (transformer/fast/linear.py) computes what F.linear computes."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import transformer.fast.linear
from transformer.devices import ISA_LIMITS, ONEDNN_ISAS_BELOW_AVX512, cpu_flags
from transformer.fast import accelerate
from transformer.fast.linear import AVAILABLE, CACHE_CAPACITY, CACHE_VARIABLES, FastLinear, linear
from transformer.model import ModelConfig, Transformer
from transformer.runtime import RuntimeConfig

pytestmark = [pytest.mark.isa, pytest.mark.skipif(not AVAILABLE, reason="oneDNN unavailable")]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("blas_weight_gradient", [False, True])
def test_forward_and_gradients_match_f_linear(bias, blas_weight_gradient, monkeypatch):
    if blas_weight_gradient:  # as for a large dY, the output layer's
        monkeypatch.setattr(transformer.fast.linear, "TRANSPOSE_LIMIT", 0)
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
    layer = FastLinear(16, 8)
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        first = layer.packed.entries[torch.float32][1]
        assert first.is_mkldnn
        layer.weight.mul_(-2.0)  # in place, as an optimizer step does
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert layer.packed.entries[torch.float32][1] is not first
        layer.bias.add_(1.0)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.load_state_dict({"weight": torch.randn(8, 16), "bias": torch.zeros(8)})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    clone = copy.deepcopy(layer)  # copies start without the packed tensor
    with torch.no_grad():
        torch.testing.assert_close(clone(x), layer(x))


def test_inference_products_go_where_they_ran_faster_and_the_choice_is_kept(tmp_path, monkeypatch):
    """runtime.onednn_linear=null: the first products of each row count (rounded up to a power of
    two) and shape alternate between packed oneDNN and BLAS, then the faster goes on, and the
    choice is kept on disk for the next process; a setting of onednn_linear forces oneDNN."""
    L = transformer.fast.linear
    now, calls = [0.0], []
    monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(L, "_CHOICES", {})
    monkeypatch.setattr(L, "_TRIALS", {})
    monkeypatch.setattr(L, "_clock", lambda: now[0])

    def timed(path, slow_below, product):  # packed slower than BLAS below `slow_below` rows, faster from there
        def run(x, *args):
            now[0] += 2.0 if (path == "packed") == (x.size(0) < slow_below) else 1.0
            calls.append((path, x.size(0)))
            return product(x, *args)

        return run

    monkeypatch.setattr(L, "_product", timed("packed", 5, L._product))
    monkeypatch.setattr(L, "_blas", timed("blas", 5, L._blas))
    layer = FastLinear(16, 8)
    layer.adopt(RuntimeConfig())
    forced = copy.deepcopy(layer)
    forced.adopt(RuntimeConfig(onednn_linear=True))
    with torch.no_grad():
        for rows in [3, 4] * L.SAMPLES + [7, 5] * L.SAMPLES:  # 3 and 4 rows share a decision, 5 and 7 too
            x = torch.randn(rows, 16)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert sorted(set(calls)) == [("blas", 4), ("blas", 5), ("packed", 3), ("packed", 7)]  # in turns
        del calls[:]
        for rows in (3, 4, 5, 7):
            layer(torch.randn(rows, 16))
        assert calls == [("blas", 3), ("blas", 4), ("packed", 5), ("packed", 7)]
        forced(torch.randn(3, 16))
        assert calls[-1] == ("packed", 3)
        monkeypatch.setattr(L, "_CHOICES", {})  # as a new process: the choices come from the file
        del calls[:]
        layer(torch.randn(2, 16))  # a row count not decided yet: timed
        layer(torch.randn(3, 16))
        layer(torch.randn(6, 16))
        assert calls[1:] == [("blas", 3), ("packed", 6)]
    assert (tmp_path / "fp32_linear_timings.json").is_file()


def test_a_model_trains_and_decodes_the_same_with_and_without_onednn():
    """runtime.onednn_linear=false (F.linear, BLAS) against the oneDNN path, on the same weights."""
    cfg = ModelConfig(vocab_size=50, n_encoder_layers=2, n_decoder_layers=2, d_model=32, n_heads=4, d_ff=64, dropout=0.0)  # fmt: skip
    src, tgt = torch.randint(4, 50, (3, 9)), torch.randint(4, 50, (3, 6))
    results = []
    for enabled in (False, True):
        torch.manual_seed(0)
        model = accelerate(Transformer(cfg), RuntimeConfig(onednn_linear=enabled))
        logits = model(src, tgt)
        logits.square().mean().backward()
        with torch.no_grad():
            inference = model(src, tgt)
        results.append((logits.detach(), inference, [p.grad.clone() for p in model.parameters()]))
    (blas, blas_inf, blas_grads), (ours, ours_inf, our_grads) = results
    torch.testing.assert_close(ours, blas, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours_inf, blas_inf, rtol=1e-4, atol=1e-5)
    for a, b in zip(our_grads, blas_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.e2e
def test_onednn_products_are_chosen_where_avx512_runs_unless_the_config_says():
    """runtime.onednn_linear=null (the default) turns the oneDNN path on for training only where
    torch runs AVX-512 kernels and for inference everywhere; in a process kept to AVX2 training
    products stay on BLAS, and bf16 autocast is not chosen."""
    # From the CPU's own flags and the limits set, not from what torch reports: AVX-512 runs where
    # the CPU has it (torch asks for F, BW, VL and DQ) and neither ATen nor oneDNN is kept below it.
    has_avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()
    aten_limited = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("default", "avx2")
    onednn_limited = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ONEDNN_ISAS_BELOW_AVX512
    assert RuntimeConfig().onednn == (has_avx512 and not aten_limited and not onednn_limited)
    code = (
        "from transformer.runtime import RuntimeConfig as R; from transformer.devices import cpu_has_bf16_matmul as b;"
        "print(R().onednn, R(onednn_linear=True).onednn, R(onednn_linear=False).onednn, b(),"
        "R().onednn_inference, R(onednn_linear=False).onednn_inference)"
    )
    env = {**os.environ, **ISA_LIMITS["avx2"]}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True", "False", "False", "True", "False"]


@pytest.mark.e2e
def test_importing_changes_nothing_and_accelerate_bounds_the_primitive_caches():
    """Importing transformer.fast leaves the environment alone; installing the oneDNN path (asked
    for, as a CPU kept to AVX2 does not choose it) sets the cache bounds the user has not set."""
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    code = (
        "import os, transformer.fast as F, transformer.model as M, transformer.runtime as R; print(*[os.environ.get(v) for v in F.linear.CACHE_VARIABLES]);"
        "F.accelerate(M.Transformer(M.ModelConfig(vocab_size=20, d_model=16, n_heads=2, d_ff=16)), R.RuntimeConfig(onednn_linear=True)); print(*[os.environ.get(v) for v in F.linear.CACHE_VARIABLES])"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["None None", f"{CACHE_CAPACITY} {CACHE_CAPACITY}"]


def test_bf16_autocast_training_keeps_torchs_own_path():
    layer, x = FastLinear(16, 8), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16 and type(out.grad_fn).__name__ == "AddmmBackward0"
    assert not layer.packed.entries


@pytest.mark.skipif(not transformer.fast.linear._BF16_SUPPORTED, reason="oneDNN has no bf16 products on this CPU")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_bf16_autocast_inference_uses_a_packed_bf16_weight_and_gives_f_linears_result(bias, activation):
    torch.manual_seed(0)
    layer, x = FastLinear(64, 48, bias=bias), torch.randn(3, 5, 64)

    def reference():  # autocast's own bf16 copy of the weight lasts until the outermost block ends
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = F.linear(x, layer.weight, layer.bias)
        return out if activation is None else F.relu(out)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, activation)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, reference(), rtol=1e-2, atol=1e-2)
        first = layer.packed.entries[torch.bfloat16][1]
        assert first.is_mkldnn and first.dtype == torch.bfloat16
        layer.weight.mul_(-1.0)  # the bf16 copy follows the weight, inside the same autocast block
        out = layer(x, activation)
        assert layer.packed.entries[torch.bfloat16][1] is not first
    torch.testing.assert_close(out, reference(), rtol=1e-2, atol=1e-2)  # outside, so it sees the change
    with torch.no_grad():  # and fp32 inference, outside autocast, keeps its own fp32 weight
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


MEMORY_PROBE = """
import os, sys
import torch
import transformer.fast.linear as L
L.bound_primitive_caches()

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

weight = torch.randn(1024, 256, requires_grad=True)
sizes = []
for i, rows in enumerate(range(2000, 2000 + 120 * 3, 3)):  # 120 shapes, one new primitive each
    x = torch.randn(rows, 256, requires_grad=True)
    L.linear(x, weight).sum().backward()
    if i in (39, 119):
        sizes.append(rss_mb())
print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"], sizes[1] - sizes[0])
"""


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the process size from /proc")
def test_memory_does_not_grow_with_the_number_of_product_shapes():
    """oneDNN keeps every product's primitive and its buffers in two caches of 1024 entries;
    installing transformer.fast.linear bounds both, so training on batches of ever new shapes stays
    the same size. With oneDNN's defaults the 80 new shapes below added 1.4 GB (3-28 MB bounded)."""
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    bounded = subprocess.run([sys.executable, "-c", MEMORY_PROBE], env=env, capture_output=True, text=True, check=True)
    cache, lru, growth = bounded.stdout.split()
    assert (cache, lru) == (str(CACHE_CAPACITY), str(CACHE_CAPACITY))
    assert float(growth) < 200, f"grew by {growth} MB over 80 new shapes"
    env.update(dict.fromkeys(CACHE_VARIABLES, "1024"))  # a user's setting is kept
    default = subprocess.run([sys.executable, "-c", MEMORY_PROBE], env=env, capture_output=True, text=True, check=True)
    cache, lru, growth = default.stdout.split()
    assert (cache, lru) == ("1024", "1024") and float(growth) > 500


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("grad", [False, True])
def test_an_activation_inside_the_product_equals_one_after_it(activation, grad):
    torch.manual_seed(0)
    layer, x = FastLinear(16, 48), torch.randn(5, 7, 16, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        fused = layer(x, activation=activation)
        after = getattr(F, activation)(F.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(fused, after, atol=1e-5, rtol=1e-5)
    if grad:
        (g1,) = torch.autograd.grad(fused.sum(), x)
        (g2,) = torch.autograd.grad(after.sum(), x)
        torch.testing.assert_close(g1, g2)
