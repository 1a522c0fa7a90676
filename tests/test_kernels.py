"""The CPU-dependent fast paths run oneDNN's optimized kernels on this CPU, or under each
instruction-set limit of `make test-isa` (tests/isa_matrix.py), never its reference
implementations (`ref...`), which are correct but can be hundreds of times slower. The kernels
are read from oneDNN's verbose output; each test records the ones it saw, and the run's summary
lists them (tests/conftest.py), so a report from any CPU says which kernels ran. One test is the
ISA matrix's proof for oneDNN: the instruction sets its kernels name are at most the limit."""

import re

import pytest
import torch
from torch import nn

import transformer.fast.int8
from transformer.devices import cpu_has_bf16_matmul
from transformer.fast.int8 import (
    NARROW_WEIGHTS,
    Int8Linear,
    describe,
    exact_weight_levels,
    kernel_available,
    kernel_plan,
    quantize_int8,
)
from transformer.fast.linear import AVAILABLE, FastLinear
from transformer.runtime import RuntimeConfig

from .isa_matrix import expected_limit

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


UNKNOWN = "unknown"  # a kernel whose name gives no instruction set (gemm:jit): it proves nothing


def kernel_isa(kernel: str) -> str:
    """The instruction set in a kernel's implementation name, or UNKNOWN for one that names none."""
    names = re.findall(r"(?:sse41|avx512_core(?:_amx_fp16|_amx|_fp16|_bf16|_vnni)?|avx2(?:_vnni_2|_vnni)?|avx)(?![a-z0-9_])", kernel)  # fmt: skip
    return max(names, key=ONEDNN_ISAS.index) if names else UNKNOWN


def beyond(kernels: list[str], limit: str) -> list[str]:
    """The kernels that name an instruction set above `limit` (ONEDNN_MAX_CPU_ISA's spelling); an
    unknown one is not among them, nor counted within the limit."""
    return [k for k in kernels if kernel_isa(k) != UNKNOWN and ONEDNN_ISAS.index(kernel_isa(k)) > ONEDNN_ISAS.index(limit.lower())]  # fmt: skip


def check(kernels: list[str], record_property, path: str) -> None:
    """No reference kernel, and none beyond the instruction set the ISA matrix's setting (or
    ONEDNN_MAX_CPU_ISA) allows: a limit the library ignored fails here instead of passing on native
    kernels."""
    labelled = [k if kernel_isa(k) != UNKNOWN else f"{k} [ISA {UNKNOWN}]" for k in kernels]
    record_property("kernels", f"{path}: {'; '.join(labelled) or 'none from oneDNN'}")
    assert not [k for k in kernels if " ref" in k], f"{path} ran oneDNN's reference kernel: {kernels}"
    limit = expected_limit("ONEDNN_MAX_CPU_ISA")
    if limit:
        assert not beyond(kernels, limit), f"{path} ran kernels beyond ONEDNN_MAX_CPU_ISA={limit}: {beyond(kernels, limit)}"  # fmt: skip


def test_kernel_names_give_their_instruction_set():
    assert kernel_isa("matmul brg_matmul:avx512_core_vnni (u8 x s8)") == "avx512_core_vnni"
    assert kernel_isa("inner_product brg_matmul:avx2 (f32 x f32)") == "avx2"
    assert kernel_isa("inner_product brgemm:avx512_core_amx (bf16 x bf16)") == "avx512_core_amx"
    assert kernel_isa("matmul gemm:jit (f32 x f32)") == UNKNOWN
    assert kernel_isa("inner_product x64:gemm:jit (bf16 x bf16)") == UNKNOWN


def test_an_unknown_kernel_is_neither_beyond_the_limit_nor_a_proof():
    kernels = ["matmul gemm:jit (u8 x s8)", "inner_product brg_matmul:avx512_core (f32 x f32)"]
    assert beyond(kernels, "AVX2") == kernels[1:]
    assert beyond(kernels, "SSE41") == kernels[1:]  # gemm:jit is not taken for sse41
    assert not beyond(kernels[:1], "SSE41")


def test_onednn_runs_the_isa_it_is_limited_to(capfd, record_property):
    """The ISA matrix's proof for oneDNN (the line "oneDNN: ..."): the products whose kernels
    differ most between CPUs (fp32, u8 x s8 and bf16) run kernels naming no instruction set above
    the setting's ONEDNN_MAX_CPU_ISA, and at least one names its set. Unknown kernels prove nothing,
    so a run of only those fails. Without a limit it records what runs."""
    torch.manual_seed(0)
    layer, x = FastLinear(64, 96), torch.randn(12, 64)
    layer.adopt(RuntimeConfig(onednn_linear=True))
    int8 = Int8Linear(nn.Linear(64, 96), NARROW_WEIGHTS) if kernel_available("onednn") else None

    def run() -> None:
        with torch.no_grad():
            layer(x)
            if int8 is not None:
                int8(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                layer(x)

    kernels, limit = onednn_kernels(capfd, run), expected_limit("ONEDNN_MAX_CPU_ISA")
    named = [k for k in kernels if kernel_isa(k) != UNKNOWN]
    highest = max(map(kernel_isa, named), key=ONEDNN_ISAS.index, default=UNKNOWN)
    unknown = [k for k in kernels if k not in named]
    line = f"oneDNN: {highest}, the highest ISA its kernels name (ONEDNN_MAX_CPU_ISA={limit or 'unset'})"
    record_property("kernels", line + (f"; ISA {UNKNOWN}: {'; '.join(unknown)}" if unknown else ""))
    assert named, f"no oneDNN kernel named its instruction set, nothing shows ONEDNN_MAX_CPU_ISA={limit} took effect: {kernels}"  # fmt: skip
    if limit:
        assert not beyond(named, limit), f"ONEDNN_MAX_CPU_ISA={limit} took no effect: oneDNN ran {beyond(named, limit)}"  # fmt: skip


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
