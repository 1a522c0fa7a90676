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

from ..runtime import RuntimeConfig
from . import attention, dropout, linear, model

log = logging.getLogger(__name__)


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
