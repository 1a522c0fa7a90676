"""Helpers shared by the benchmark scripts: what hardware we ran on, and timing."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def hardware() -> dict:
    """The device and CPU features, so figures from different machines are never compared blindly."""
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next(
            (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), ""
        )
        flags = set(
            next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
        )
        info["cpu"] = model
        info["cpu_features"] = [f for f in CPU_FLAGS_OF_INTEREST if f in flags]
    except OSError:
        info["cpu"] = platform.processor()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def timed(fn, device: torch.device) -> tuple[float, object]:
    """(seconds, result) of fn(), synchronizing the device around it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result
