"""Where training and decoding run: the device, and the precision of matrix products under
autocast (bf16 on GPUs and on CPUs with AMX bf16 instructions, fp16 on older GPUs, else fp32)."""

from __future__ import annotations

from pathlib import Path

import torch

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype matrix products run in under autocast; None means plain fp32."""
    if precision == "auto":
        if device.type == "cuda":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            precision = "bf16" if cpu_has_amx() else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
