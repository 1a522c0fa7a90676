"""Each instruction-set limit of the ISA matrix (tests/isa_matrix.py, ISA_LIMITS in
transformer/devices.py) takes effect, as each library itself reports what it runs: ATen the
capability ATEN_CPU_CAPABILITY names, MKL (its MKL_VERBOSE banner) no code path above
MKL_ENABLE_INSTRUCTIONS, FBGEMM (its own dispatch function, and its products' saturation) no set
above FBGEMM_ENABLE_INSTRUCTIONS, and CTranslate2 the ISA CT2_FORCE_CPU_ISA names. (oneDNN's
kernels are checked against ONEDNN_MAX_CPU_ISA in tests/test_kernels.py.) Under the matrix the
limits compared with are the setting's (expected_limit), so a variable lost on the way fails;
without a limit the tests record what runs. A library that ignored its variable would otherwise
pass the matrix on native kernels. Where a library does not say what it runs, its line says
"not proven" rather than claim it."""

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer.devices import cpu_flags
from transformer.fast.int8 import NARROW_WEIGHTS, exact_weight_levels, kernel_available

from .briefly_trained import multi30k_corpus, trained_model
from .isa_matrix import NOT_PROVEN, expected_limit

pytestmark = pytest.mark.isa


def test_aten_runs_the_capability_it_is_limited_to(record_property):
    capability = torch.backends.cpu.get_cpu_capability()
    limit = expected_limit("ATEN_CPU_CAPABILITY")
    record_property("kernels", f"ATen: {capability} (ATEN_CPU_CAPABILITY={limit or 'unset'})")
    if limit:
        assert capability == limit.upper(), f"ATEN_CPU_CAPABILITY={limit} took no effect: ATen runs {capability}"


# Limits whose int8 products have no VNNI: pairs of u8 x s8 products are summed in 16 bits, which
# saturates with full-range weights on every CPU. FBGEMM's, and oneDNN's that the ISA matrix pairs
# with FBGEMM's (FBGEMM must be kept to the CPU the setting stands for, as oneDNN is).
FBGEMM_WITHOUT_VNNI = ("AVX2", "AVX512", "AVX512_256")
ONEDNN_WITHOUT_VNNI = ("SSE41", "AVX", "AVX2", "AVX512_CORE")


def test_fbgemm_products_saturate_as_the_limit_says(record_property):
    """FBGEMM says nothing of its kernels, but they show in its products: where the limits name a
    set without VNNI, full-range int8 weights saturate (the start-up check narrows them), whatever
    the CPU has. A limit FBGEMM ignored, or an ISA setting without FBGEMM's limit, would give exact
    full-range products on a VNNI CPU."""
    if not kernel_available("fbgemm"):
        record_property("kernels", "FBGEMM int8 products: none in this torch")
        return
    levels = exact_weight_levels("fbgemm")
    limit, onednn = expected_limit("FBGEMM_ENABLE_INSTRUCTIONS") or "", expected_limit("ONEDNN_MAX_CPU_ISA") or ""
    record_property("kernels", f"FBGEMM int8 products: weights exact up to {levels} (FBGEMM_ENABLE_INSTRUCTIONS={limit or 'unset'})")  # fmt: skip
    if limit.upper() in FBGEMM_WITHOUT_VNNI or onednn.upper() in ONEDNN_WITHOUT_VNNI:
        assert levels == NARROW_WEIGHTS, f"FBGEMM_ENABLE_INSTRUCTIONS={limit or 'unset'} (ONEDNN_MAX_CPU_ISA={onednn or 'unset'}): full-range products exact, so FBGEMM ran VNNI"  # fmt: skip


# FBGEMM's inst_set_t (fbgemm/Utils.h), by value, and what each FBGEMM_ENABLE_INSTRUCTIONS value
# allows (FBGEMM keeps the CPU's own set where the CPU lacks the one named).
FBGEMM_ISAS = ("anyarch", "avx2", "avx512", "avx512_ymm", "avx512_vnni", "avx512_vnni_ymm", "sve")
FBGEMM_ALLOWED = {
    "AVX2": {"anyarch", "avx2"},
    "AVX512_256": {"anyarch", "avx2", "avx512_ymm"},
    "AVX512": {"anyarch", "avx2", "avx512_ymm", "avx512"},
    "AVX512_E1_256": {"anyarch", "avx2", "avx512_ymm", "avx512_vnni_ymm"},
    "AVX512_E1": {"anyarch", "avx2", "avx512_ymm", "avx512", "avx512_vnni_ymm", "avx512_vnni"},
}


def fbgemm_instruction_set() -> str | None:
    """The instruction set FBGEMM's kernels dispatch to in this process, as fbgemm::fbgemmInstructionSet()
    (which every FBGEMM product consults) returns it; None where torch's library does not export it or
    its values no longer match FBGEMM_ISAS (checked against fbgemm::isZmm, true for the 512-bit ones)."""
    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        instruction_set, is_zmm = library._ZN6fbgemm20fbgemmInstructionSetEv, library._ZN6fbgemm5isZmmENS_10inst_set_tE
    except (OSError, AttributeError):
        return None
    instruction_set.restype, is_zmm.restype, is_zmm.argtypes = ctypes.c_int, ctypes.c_bool, [ctypes.c_int]
    zmm = [name for value, name in enumerate(FBGEMM_ISAS) if is_zmm(value)]
    value = instruction_set()
    return FBGEMM_ISAS[value] if zmm == ["avx512", "avx512_vnni"] and value < len(FBGEMM_ISAS) else None


def test_fbgemm_runs_the_instructions_it_is_limited_to(record_property):
    """The ISA matrix's proof for FBGEMM (the line "FBGEMM: ..."): the instruction set FBGEMM's own
    dispatch chose in this process is within FBGEMM_ENABLE_INSTRUCTIONS. It shows the set FBGEMM's
    kernels are generated for, not an instruction trace of one product; the saturation test above
    shows the same limit in the products themselves."""
    if not kernel_available("fbgemm"):
        record_property("kernels", "FBGEMM: none in this torch")
        return
    isa, limit = fbgemm_instruction_set(), expected_limit("FBGEMM_ENABLE_INSTRUCTIONS")
    if isa is None:
        reason = "this torch does not export fbgemm::fbgemmInstructionSet, or its values changed"
        verdict = f"FBGEMM_ENABLE_INSTRUCTIONS={limit} {NOT_PROVEN}" if limit else "no limit"
        record_property("kernels", f"FBGEMM: ISA unknown; {verdict}: {reason}")
        return
    record_property("kernels", f"FBGEMM: {isa}, by fbgemmInstructionSet() (FBGEMM_ENABLE_INSTRUCTIONS={limit or 'unset'})")  # fmt: skip
    if limit:
        assert limit.upper() in FBGEMM_ALLOWED, f"FBGEMM_ENABLE_INSTRUCTIONS={limit} is not a value FBGEMM reads: {sorted(FBGEMM_ALLOWED)}"  # fmt: skip
        assert isa in FBGEMM_ALLOWED[limit.upper()], f"FBGEMM_ENABLE_INSTRUCTIONS={limit} took no effect: FBGEMM dispatches to {isa}"  # fmt: skip


# MKL's code paths, lowest first, by their MKL_ENABLE_INSTRUCTIONS names and as the first line of
# MKL_VERBOSE's output names them ("... for Intel(R) 64 architecture <path>[ enabled processors], Lnx ...").
AVX512 = "Intel(R) Advanced Vector Extensions 512 (Intel(R) AVX-512)"
DL_BOOST = "with support of Intel(R) Deep Learning Boost (Intel(R) DL Boost)"
MKL_PATHS = {
    "SSE4_2": "Intel(R) Streaming SIMD Extensions 4.2 (Intel(R) SSE4.2)",
    "AVX": "Intel(R) Advanced Vector Extensions (Intel(R) AVX)",
    "AVX2": "Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2)",
    "AVX2_E1": f"Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX-2) {DL_BOOST}",
    "AVX512": AVX512,
    "AVX512_E1": f"{AVX512} {DL_BOOST}",
    "AVX512_E2": f"{AVX512} {DL_BOOST}, EVEX-encoded AES and Carry-Less Multiplication Quadword instructions",
    "AVX512_E3": f"{AVX512} {DL_BOOST} and bfloat16",
    "AVX512_E4": f"{AVX512} with support for INT8, BF16, FP16 (limited) instructions, and Intel(R) Advanced Matrix Extensions (Intel(R) AMX) with INT8 and BF16",  # fmt: skip
    "AVX512_E5": f"{AVX512} with support for INT8, BF16, FP16 (limited) instructions, and Intel(R) Advanced Matrix Extensions (Intel(R) AMX) with INT8, BF16, and FP16",  # fmt: skip
}
# The path MKL takes on CPUs not made by Intel: it names no instruction set, and MKL_ENABLE_INSTRUCTIONS
# does not steer it (oneMKL's guide: "This feature is not available on non-Intel processors").
MKL_NON_INTEL = "Intel(R) Architecture processors"


def mkl_path(verbose: str) -> tuple[str | None, str]:
    """(MKL_ENABLE_INSTRUCTIONS's name for the code path MKL dispatched to, or None where the
    banner names none we know; the banner's own words) from MKL_VERBOSE's output."""
    banner = re.search(r"for Intel\(R\) 64 architecture (.+?), \w+ [\d.]+GHz", verbose)
    assert banner, f"MKL_VERBOSE printed no banner naming its code path: {verbose[-500:]}"
    words = banner[1].removesuffix(" enabled processors")
    return next((name for name, path in MKL_PATHS.items() if path == words), None), banner[1]


def mkl_beyond(path: str, limit: str) -> bool:
    """Whether MKL's code path is above MKL_ENABLE_INSTRUCTIONS=limit (MKL_PATHS's order)."""
    assert limit.upper() in MKL_PATHS, f"MKL_ENABLE_INSTRUCTIONS={limit} is not one of {list(MKL_PATHS)}"
    return list(MKL_PATHS).index(path) > list(MKL_PATHS).index(limit.upper())


def test_mkl_banners_name_their_paths():
    """The parsing the MKL proof rests on, with banners as MKL prints them on Intel CPUs."""
    amx = f"MKL_VERBOSE oneMKL 2024.0 Update 2 Patch 2 Product build 20240823 for Intel(R) 64 architecture {MKL_PATHS['AVX512_E4']}, Lnx 2.00GHz intel_thread"  # fmt: skip
    avx2 = "MKL_VERBOSE oneMKL 2025 Update 1 Product build 20250306 for Intel(R) 64 architecture Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors, Lnx 2.40GHz lp64 gnu_thread"  # fmt: skip
    assert mkl_path(amx)[0] == "AVX512_E4" and mkl_path(avx2)[0] == "AVX2"
    assert mkl_beyond("AVX512_E4", "AVX512") and mkl_beyond("AVX512", "AVX2") and not mkl_beyond("AVX2", "AVX2")
    assert mkl_path(avx2.replace("Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors", MKL_NON_INTEL))[0] is None  # fmt: skip


def test_mkl_runs_the_instructions_it_is_limited_to(record_property):
    """The ISA matrix's proof for MKL (the line "MKL: ..."): a small sgemm run with MKL_VERBOSE=1 in
    a fresh process (MKL prints its banner once a process) runs on MKL, and the code path MKL's
    banner names is not above MKL_ENABLE_INSTRUCTIONS. Where the banner names no instruction set
    (MKL's path for CPUs not made by Intel), the line says the limit is not proven."""
    if not torch.backends.mkl.is_available():
        record_property("kernels", "MKL: none in this torch")
        return
    code = "import torch; torch.mm(torch.randn(64, 64), torch.randn(64, 64))"
    env = {**os.environ, "MKL_VERBOSE": "1"}
    verbose = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "MKL_VERBOSE SGEMM" in verbose, f"the product did not run on MKL's sgemm: {verbose[-500:]}"
    (path, words), limit = mkl_path(verbose), expected_limit("MKL_ENABLE_INSTRUCTIONS")
    if path is None:
        why = "MKL's path for CPUs not made by Intel, which the variable does not steer" if words == MKL_NON_INTEL else "a path this test does not know"  # fmt: skip
        verdict = f"MKL_ENABLE_INSTRUCTIONS={limit} {NOT_PROVEN}" if limit else "no limit"
        record_property("kernels", f"MKL: ISA unknown, MKL_VERBOSE says '{words}'; {verdict}: {why}")
        return
    record_property("kernels", f"MKL: {path}, by MKL_VERBOSE (MKL_ENABLE_INSTRUCTIONS={limit or 'unset'})")
    if limit:
        assert not mkl_beyond(path, limit), f"MKL_ENABLE_INSTRUCTIONS={limit} took no effect: MKL_VERBOSE says '{words}'"  # fmt: skip


def test_ctranslate2_runs_the_isa_it_is_limited_to(tmp_path, record_property):
    pytest.importorskip("ctranslate2")
    from transformer.interop.export import export

    model, tokenizer = trained_model(multi30k_corpus(), {}, steps=0)
    export(model, tokenizer, tmp_path / "ct2", "float32")
    code = f"import ctranslate2; ctranslate2.Translator({str(tmp_path / 'ct2')!r}, device='cpu')"
    env = {**os.environ, "CT2_VERBOSE": "1"}
    log = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stderr
    selected = re.search(r"Selected ISA: (\w+)", log)
    assert selected, f"CTranslate2 did not say which ISA it selected: {log[-500:]}"
    limit = expected_limit("CT2_FORCE_CPU_ISA")
    record_property("kernels", f"CTranslate2: {selected[1]} (CT2_FORCE_CPU_ISA={limit or 'unset'})")
    if limit:
        assert selected[1] == limit, f"CT2_FORCE_CPU_ISA={limit} took no effect: CTranslate2 selected {selected[1]}"
    if not limit and "avx512f" not in cpu_flags():
        assert selected[1] != "AVX512"
