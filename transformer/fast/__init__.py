"""The speed paths: each module replaces one piece of the reference model (transformer/model.py,
transformer/attention.py, transformer/blocks.py) or of the training objective with a faster one
that computes the same thing, and is tested against it (tests/test_fast.py).

    linear.py     nn.Linear's forward on oneDNN for CPU fp32, weights packed for inference
    int8.py       linear layers in int8 for CPU decoding (decode.precision=int8), inputs quantized per row, on oneDNN
    attention.py  attention kernels, in-place caches, fp32 cross-attention cache, folded beams
    cache.py      key/value caches that grow in place and reorder only the rows that move
    dropout.py    dropout masks drawn cheaply on a CPU
    encoding.py   encoding in groups of similar length at CPU inference
    loss.py       the output layer and its loss in chunks, without the full logits
    model.py      the classes `accelerate` gives the model, its decoder layers and FFNs

`accelerate(model, runtime)` installs them on a built model, in place: same parameters, same
state dict. The typed config group `runtime` (configs/runtime/) chooses: runtime=fast (the
default) or runtime=reference, the model exactly as written. docs/PERFORMANCE.md has what each
is worth and where it was measured. The reference model never imports this package.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

from ..devices import cpu_has_bf16_matmul, cpu_runs_avx512, describe_cpu
from . import attention, dropout, linear, model

log = logging.getLogger(__name__)


@dataclass
class RuntimeConfig:
    fast: bool = True  # false: the reference model exactly as written (runtime=reference)
    onednn_linear: Optional[bool] = None  # oneDNN for CPU fp32 linear layers (fast/linear.py); null: with AVX-512
    fp32_cross: bool = True  # bf16 decoding on CPU keeps cross-attention keys and values in fp32
    chunked_loss: bool = True  # the output layer and its loss in chunks, never the full logits (fast/loss.py)

    @property
    def onednn(self) -> bool:
        """Whether fp32 linear layers run on oneDNN: as onednn_linear says, or when it is null
        (the default), where the CPU runs AVX-512. There oneDNN's products beat torch's BLAS; on
        CPUs kept to AVX2 they are slower (docs/PERFORMANCE.md), so BLAS is kept."""
        return self.onednn_linear if self.onednn_linear is not None else cpu_runs_avx512()

    def describe(self) -> str:
        """What this runtime installs on this CPU, and why: one line for the log."""
        auto = "bf16" if cpu_has_bf16_matmul() else "fp32 (no usable bf16 matrix instructions)"
        if not self.fast:
            return f"runtime=reference: the model as written, no speed paths; precision=auto: {auto} | {describe_cpu()}"
        if self.onednn_linear is None:
            why = "runtime.onednn_linear=null and AVX-512 runs" if self.onednn else "runtime.onednn_linear=null and no AVX-512"  # fmt: skip
        else:
            why = f"runtime.onednn_linear={str(self.onednn_linear).lower()}"
        return (
            f"speed paths: fp32 linear layers on {'oneDNN' if self.onednn else 'BLAS'} ({why}); attention "
            f"kernels and caches; cheap dropout masks{'; chunked loss' if self.chunked_loss else ''}; "
            f"precision=auto: {auto} | {describe_cpu()}"
        )


@functools.cache
def log_once(message: str) -> None:
    """Log `message` the first time it is given in this process (a process builds many models)."""
    log.info(message)


def accelerate(transformer, runtime: RuntimeConfig | None = None):
    """Install the speed paths `runtime` asks for on `transformer` (a Transformer, in place; the
    same parameters and state dict) and return it. runtime.fast=false leaves it as it is. The
    first call in a process logs what was installed for this CPU and why."""
    runtime = runtime or RuntimeConfig()
    log_once(runtime.describe())
    if not runtime.fast:
        return transformer
    linear.install(transformer, runtime.onednn)
    dropout.install(transformer)
    attention.install(transformer, runtime.fp32_cross)
    model.install(transformer, runtime.onednn)
    return transformer
