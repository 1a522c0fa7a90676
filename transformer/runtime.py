"""The runtime: which speed paths (transformer/fast/) a model runs with, `runtime.*` in the configs.

It is a plain setting, read by every command; the speed package itself is imported only where the
paths are installed (transformer.fast.accelerate), so configs and the reference model never load it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .devices import PRECISIONS, cpu_has_bf16_matmul, cpu_runs_avx512, describe_cpu

# What a loaded model decodes in (CTranslate2's compute_type): fp32, bf16 or fp16 autocast (auto:
# bf16 on CPUs with bf16 matrix instructions and on GPUs), or int8 linear layers on a CPU (fast/int8.py).
DECODE_PRECISIONS = (*PRECISIONS, "int8")


@dataclass
class RuntimeConfig:
    fast: bool = True  # false: the reference model exactly as written (runtime=reference)
    onednn_linear: Optional[bool] = None  # oneDNN for fp32 linear layers; null: at inference, in training with AVX-512
    fp32_cross: bool = True  # bf16 decoding on CPU keeps cross-attention keys and values in fp32
    chunked_loss: bool = True  # the output layer and its loss in chunks, never the full logits (fast/loss.py)
    compiled_step: Optional[bool] = None  # decoding steps compiled ahead of time (fast/compiled.py); null: a kept one
    precision: str = "fp32"  # what a loaded model decodes in, chosen when it loads: fp32|bf16|fp16|auto|int8

    def __post_init__(self) -> None:
        if self.precision not in DECODE_PRECISIONS:
            raise ValueError(f"runtime.precision={self.precision!r} is not one of {DECODE_PRECISIONS}")

    @property
    def onednn(self) -> bool:
        """Whether fp32 linear layers run on oneDNN: as onednn_linear says, or when it is null
        (the default), where the CPU runs AVX-512. There oneDNN's products beat torch's BLAS; on
        CPUs kept to AVX2 they are slower (docs/PERFORMANCE.md), so BLAS is kept."""
        return self.onednn_linear if self.onednn_linear is not None else cpu_runs_avx512()

    @property
    def onednn_inference(self) -> bool:
        """Whether fp32 linear layers may run on oneDNN at inference (no gradients; the weight
        reordered once for oneDNN): as onednn_linear says, or when it is null, on every CPU, each
        product where it ran faster than BLAS (inference_by_rows, docs/PERFORMANCE.md)."""
        return self.onednn_linear if self.onednn_linear is not None else True

    @property
    def inference_by_rows(self) -> bool:
        """Whether, at inference, each fp32 product goes packed to oneDNN or to BLAS by its shape
        and row count, whichever ran faster in its first products on this machine (fast/linear.py:
        by_rows): when onednn_linear is null. A setting forces one library."""
        return self.onednn_linear is None

    def why_onednn(self) -> str:
        if self.onednn_linear is None:
            return "runtime.onednn_linear=null and " + ("AVX-512 runs" if self.onednn else "no AVX-512")
        return f"runtime.onednn_linear={str(self.onednn_linear).lower()}"

    def linear_paths(self) -> str:
        """Where fp32 linear layers run, for the log line."""
        train = "oneDNN" if self.onednn else "BLAS"
        infer = "oneDNN" if self.onednn_inference else "BLAS"
        if self.inference_by_rows:
            return f"fp32 linear layers at inference on oneDNN or BLAS, whichever ran faster here at each shape and row count; in training on {train} ({self.why_onednn()})"  # fmt: skip
        if train == infer:
            return f"fp32 linear layers on {train} ({self.why_onednn()})"
        return f"fp32 linear layers on {infer} at inference, on {train} in training ({self.why_onednn()})"

    def describe(self) -> str:
        """What this runtime chooses on this CPU, and why: one line for the log."""
        auto = "bf16" if cpu_has_bf16_matmul() else "fp32, no usable bf16 matrix instructions"
        precision = f"runtime.precision={self.precision} (auto: {auto})"
        if not self.fast:
            return (
                "runtime=reference: the model as written, no speed paths; decoding caches: KeyValueCache "
                f"(torch.cat); {precision} | {describe_cpu()}"
            )
        return (
            f"runtime=fast: {self.linear_paths()}; attention: fast_attention; decoding caches: FastKeyValueCache "
            "(grown in place; a paged pool under scheduler=continuous); "
            f"chunked loss {'on' if self.chunked_loss else 'off'}; {precision} | {describe_cpu()}"
        )
