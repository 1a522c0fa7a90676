"""The CPU-dependent fast paths run oneDNN's optimized kernels on this CPU, or under each
instruction-set limit of `make test-isa` (tests/isa_matrix.py), never its reference
implementations (`ref...`), which are correct but can be hundreds of times slower. The kernels
are read from oneDNN's verbose output; each test records the ones it saw, and the run's summary
lists them (tests/conftest.py), so a report from any CPU says which kernels ran."""

import pytest
import torch
from torch import nn

from transformer.devices import cpu_has_bf16_matmul
from transformer.fast.int8 import Int8Linear, describe, exact_weight_levels, kernel_plan, quantize_int8
from transformer.fast.linear import AVAILABLE, FastLinear
from transformer.runtime import RuntimeConfig

pytestmark = [pytest.mark.isa, pytest.mark.skipif(not AVAILABLE, reason="oneDNN unavailable")]


def onednn_kernels(capfd, fn) -> list[str]:
    """The matrix-product kernels oneDNN executed while fn() ran, as 'primitive implementation
    (source x weight types)', e.g. 'matmul brg_matmul:avx512_core_vnni (u8 x s8)'."""
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        fn()
    kernels = set()
    for line in capfd.readouterr().out.splitlines():
        fields = line.split(",")
        if fields[1:4] != ["v1", "primitive", "exec"] or fields[5] not in ("matmul", "inner_product"):
            continue
        types = {d.split(":")[0]: d.split(":")[1] for d in fields[8].split() if ":" in d}
        kernels.add(f"{fields[5]} {fields[6]} ({types.get('src')} x {types.get('wei')})")
    return sorted(kernels)


def check(kernels: list[str], record_property, path: str) -> None:
    record_property("kernels", f"{path}: {'; '.join(kernels) or 'none from oneDNN'}")
    assert not [k for k in kernels if " ref" in k], f"{path} ran oneDNN's reference kernel: {kernels}"


def test_fp32_linear_layers_run_optimized_kernels(capfd, record_property):
    """Inference (packed weights) and a training step, each on the products runtime.onednn_linear=null
    chooses here (inference: oneDNN on every CPU; training: oneDNN where AVX-512 runs, else BLAS),
    and on oneDNN when it is asked for."""
    torch.manual_seed(0)
    layer, x = FastLinear(64, 96), torch.randn(12, 64)
    runtime = RuntimeConfig()
    layer.adopt(runtime)

    def infer() -> None:
        with torch.no_grad():
            layer(x)

    def train() -> None:
        layer(x.requires_grad_()).sum().backward()

    kernels = onednn_kernels(capfd, infer)
    check(kernels, record_property, "fp32 linear inference (runtime.onednn_linear=null: oneDNN)")
    assert kernels, "inference products did not run on oneDNN"
    kernels = onednn_kernels(capfd, train)
    library = "oneDNN" if runtime.onednn else "BLAS"
    check(kernels, record_property, f"fp32 linear training (runtime.onednn_linear=null: {library})")
    assert bool(kernels) == runtime.onednn  # BLAS leaves oneDNN idle
    layer.adopt(RuntimeConfig(onednn_linear=True))
    check(onednn_kernels(capfd, train), record_property, "fp32 linear training (runtime.onednn_linear=true)")
    layer.adopt(RuntimeConfig(onednn_linear=False))
    assert not onednn_kernels(capfd, infer), "runtime.onednn_linear=false still ran oneDNN at inference"


def test_bf16_autocast_inference_runs_optimized_kernels(capfd, record_property):
    """precision=auto decodes under bf16 autocast where the CPU has bf16 matrix instructions."""
    if not cpu_has_bf16_matmul():
        record_property("kernels", "bf16 autocast: not used (no usable bf16 matrix instructions)")
        pytest.skip("no usable bf16 matrix instructions: precision=auto decodes in fp32")
    torch.manual_seed(0)
    layer, x = FastLinear(64, 96), torch.randn(12, 64)

    def run() -> None:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)

    kernels = onednn_kernels(capfd, run)
    check(kernels, record_property, "bf16 autocast linear")
    assert any("bf16" in k for k in kernels)


def test_int8_layers_run_optimized_kernels_or_stay_fp32(capfd, record_property):
    """Where int8 products are exact here, an Int8Linear runs an optimized u8 x s8 kernel (the
    start-up check then decides by speed, shape by shape, whether decoding uses it); where they
    are not, quantize_int8 leaves the layers in fp32."""
    levels, shape = exact_weight_levels(), (256, 1024)
    decision = f"start-up check: {describe({shape: kernel_plan(RuntimeConfig().onednn_inference, shape)})}"
    if levels is None:
        record_property("kernels", f"int8 linear: not used; {decision}")
        assert type(quantize_int8(nn.Sequential(nn.FastLinear(64, 96)))[0]) is nn.Linear
        return
    layer = Int8Linear(nn.Linear(*shape), levels)
    with torch.no_grad():
        kernels = onednn_kernels(capfd, lambda: layer(torch.randn(12, shape[0])))
    check(kernels, record_property, f"int8 linear, weights in [-{levels}, {levels}]; {decision}")
    assert kernels and all("(u8 x s8)" in k for k in kernels)
