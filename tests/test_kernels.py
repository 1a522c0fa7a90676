"""The CPU-dependent fast paths run oneDNN's optimized kernels on this CPU, or under each
instruction-set limit of `make test-isa` (tests/isa_matrix.py), never its reference
implementations (`ref...`), which are correct but can be hundreds of times slower. The kernels
are read from oneDNN's verbose output; each test records the ones it saw, and the run's summary
lists them (tests/conftest.py), so a report from any CPU says which kernels ran."""

import os
import re

import pytest
import torch
from torch import nn

import transformer.fast.int8
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


# oneDNN's instruction sets on x86, lowest first, as its kernels are named ("brg_matmul:avx512_core_vnni")
# and as ONEDNN_MAX_CPU_ISA spells them (upper case).
ONEDNN_ISAS = ["sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni",
               "avx512_core_bf16", "avx512_core_fp16", "avx512_core_amx", "avx512_core_amx_fp16"]  # fmt: skip


def kernel_isa(kernel: str) -> str | None:
    """The instruction set in a kernel's implementation name, or None for one that names none."""
    names = re.findall(r"(?:sse41|avx512_core(?:_amx_fp16|_amx|_fp16|_bf16|_vnni)?|avx2(?:_vnni_2|_vnni)?|avx)(?![a-z0-9_])", kernel)  # fmt: skip
    return max(names, key=ONEDNN_ISAS.index) if names else None


def check(kernels: list[str], record_property, path: str) -> None:
    """No reference kernel, and none beyond the instruction set ONEDNN_MAX_CPU_ISA allows: a limit
    the library ignored fails here instead of passing on native kernels."""
    record_property("kernels", f"{path}: {'; '.join(kernels) or 'none from oneDNN'}")
    assert not [k for k in kernels if " ref" in k], f"{path} ran oneDNN's reference kernel: {kernels}"
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "").lower()
    if limit in ONEDNN_ISAS:
        beyond = [k for k in kernels if ONEDNN_ISAS.index(kernel_isa(k) or "sse41") > ONEDNN_ISAS.index(limit)]
        assert not beyond, f"{path} ran kernels beyond ONEDNN_MAX_CPU_ISA={limit.upper()}: {beyond}"


def test_kernel_names_give_their_instruction_set():
    assert kernel_isa("matmul brg_matmul:avx512_core_vnni (u8 x s8)") == "avx512_core_vnni"
    assert kernel_isa("inner_product brg_matmul:avx2 (f32 x f32)") == "avx2"
    assert kernel_isa("inner_product brgemm:avx512_core_amx (bf16 x bf16)") == "avx512_core_amx"
    assert kernel_isa("matmul gemm:jit (f32 x f32)") is None


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
    kernels = onednn_kernels(capfd, train)
    check(kernels, record_property, "fp32 linear training (runtime.onednn_linear=true)")
    assert kernels, "runtime.onednn_linear=true trained on BLAS"
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
        assert type(quantize_int8(nn.Sequential(FastLinear(64, 96)))[0]) is FastLinear
        return
    layer = Int8Linear(nn.Linear(*shape), levels)
    with torch.no_grad():
        kernels = onednn_kernels(capfd, lambda: layer(torch.randn(12, shape[0])))
    check(kernels, record_property, f"int8 linear, weights in [-{levels}, {levels}]; {decision}")
    assert kernels and all("(u8 x s8)" in k for k in kernels)


def test_where_int8_products_are_not_exact_the_layers_stay_fp32(monkeypatch):
    """The other branch of the test above, whatever this CPU's int8 products do."""
    monkeypatch.setattr(transformer.fast.int8, "exact_weight_levels", lambda kernel="onednn": None)
    kernel_plan.cache_clear()
    try:
        layers = quantize_int8(nn.Sequential(FastLinear(64, 96), nn.Linear(96, 32)))
    finally:
        kernel_plan.cache_clear()
    assert [type(layer) for layer in layers] == [FastLinear, nn.Linear]
