"""Where training and decoding run: the device, and the precision of matrix products under
autocast (bf16 on GPUs and on CPUs with bf16 matrix instructions, fp16 on older GPUs, else fp32)."""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

import torch

from .errors import ConfigError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")  # Intel AMX tiles; AVX512-BF16 dot products (Intel, AMD Zen 4+)
# oneDNN's ONEDNN_MAX_CPU_ISA values below AVX512-BF16: a process kept to one of them has no bf16 matrix instructions
ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI")
ONEDNN_ISAS_BELOW_AVX512 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from cpuinfo, the text of /proc/cpuinfo (read when not given)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    return set(next((line.split(":", 1)[-1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []))


@functools.cache
def cpu_info(field: str, default: str) -> str:
    """A field of the first CPU in /proc/cpuinfo ("model name", "vendor_id"), or `default`."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return default
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == field), default)


def cpu_has_bf16_matmul(cpuinfo: str | None = None) -> bool:
    """Whether the CPU multiplies bf16 matrices in hardware: there bf16 matmul measured 4-7x the
    fp32 rate (AMX on a Xeon, AVX512-BF16 on an AMD EPYC); elsewhere bf16 is emulated and slow."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ONEDNN_ISAS_WITHOUT_BF16:
        return False  # the CPU has them, but this process may not use them (e.g. benchmarks' isa=avx2)
    return any(flag in cpu_flags(cpuinfo) for flag in BF16_MATMUL_FLAGS)


# The CPU features the fast paths depend on (bf16 and int8 matrix instructions, vector widths),
# and the variables that keep a library below what the CPU has (set before torch is imported).
CPU_FEATURES = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "FBGEMM_ENABLE_INSTRUCTIONS")

# The variables that keep oneDNN, ATen's own kernels, MKL, FBGEMM (torch's other int8 product; it
# reads none of the others) and CTranslate2 to lower instruction sets, as on other CPUs: read when
# each library starts, so set before torch is imported. A limit above what the CPU has changes
# nothing. Used by the benchmarks' isa= option (benchmarks/) and by tests/isa_matrix.py.
ISA_LIMITS = {
    "avx2": {  # AVX2 only: an AMD Zen 3, most laptops
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
        "CT2_FORCE_CPU_ISA": "AVX2",
    },
    "avx512_core": {  # AVX-512 without VNNI or BF16: a Skylake-class Xeon
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512",
        "CT2_FORCE_CPU_ISA": "AVX512",
    },
    "avx512_core_bf16": {  # AVX-512 with VNNI and BF16, no AMX: an AMD Zen 4 or 5
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "CT2_FORCE_CPU_ISA": "AVX512",
    },
}


def limit_isa(isa: str | None, script: str, argv: list[str]) -> None:
    """With isa="avx2" (or another key of ISA_LIMITS), run `script argv` again in a process whose
    libraries use no instruction beyond that set, unless this one already is that process; measurement processes it
    starts inherit the limit. isa=None: nothing."""
    if isa is None:
        return
    if isa not in ISA_LIMITS:
        raise ValueError(f"isa={isa!r} is not one of {tuple(ISA_LIMITS)}")
    limits = ISA_LIMITS[isa]
    if any(os.environ.get(key) != value for key, value in limits.items()):
        os.execve(sys.executable, [sys.executable, script, *argv], {**os.environ, **limits})


def isa_limit() -> str | None:
    """The ISA_LIMITS this process runs under, if any."""
    return next((isa for isa, limits in ISA_LIMITS.items() if all(os.environ.get(k) == v for k, v in limits.items())), None)  # fmt: skip


def describe_cpu() -> str:
    """One line for logs and bug reports: the CPU features found, what ATen runs, and any limit."""
    flags = cpu_flags()
    found = " ".join(f for f in CPU_FEATURES if f in flags) or "none of " + "/".join(CPU_FEATURES)
    limits = ", ".join(f"{v}={os.environ[v]}" for v in ISA_VARIABLES if os.environ.get(v))
    line = f"CPU features {found}; ATen kernels {torch.backends.cpu.get_cpu_capability()}"
    return line + (f"; limited by {limits}" if limits else "")


def cpu_runs_avx512() -> bool:
    """Whether torch's CPU kernels run AVX-512 here: the CPU has it and neither ATen
    (ATEN_CPU_CAPABILITY) nor oneDNN (ONEDNN_MAX_CPU_ISA) is kept below it."""
    limited = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ONEDNN_ISAS_BELOW_AVX512
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and not limited


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype matrix products run in under autocast; None means plain fp32 (and int8, a
    decoding precision that lives in the model's layers, fast/int8.py)."""
    if precision == "int8":
        return None
    if precision == "auto":
        if device.type == "cuda":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            precision = "bf16" if cpu_has_bf16_matmul() else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def require_cpp_compiler(
    device: torch.device, option: str = "trainer.compile=true", instead: str = "set trainer.compile=false"
) -> None:
    """torch.compile on a CPU writes C++ kernels at the first step: without a compiler, say so
    before anything is trained or measured rather than with a traceback a minute in."""
    compiler = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")  # torch.compile's choice
    if device.type == "cpu" and shutil.which(compiler) is None:
        raise ConfigError(
            f"{option} needs a C++ compiler on a CPU, and {compiler} (CXX, or the default) was not "
            f"found: install one (e.g. apt install g++), point CXX at one, or {instead}"
        )
