"""The speed paths: each fast class replaces one reference class of the model (transformer/model/:
transformer.py, attention.py, blocks.py) with a subclass that computes the same thing faster, and
is tested against it (tests/test_fast.py). Caches are objects the decoding state makes
(FastTransformer.new_state), not steps of a class.

    linear.py     FastLinear: nn.Linear on oneDNN for CPU fp32, weights packed for inference
    attention.py  FastMultiHeadAttention: attention kernels (fp32 attention to an fp32 cache under bf16)
    model.py      FastTransformer (length-grouped encoding, packed output layer, chunked loss),
                  FastDecoderLayer (folded beams), FastFeedForward, FastRotary
    dropout.py    FastDropout: masks drawn cheaply on a CPU
    cache.py      FastKeyValueCache: caches that grow in place and reorder only the rows that move;
                  the encoder's keys and values contiguous (fp32 under bf16, runtime.fp32_cross)
    paged.py      the paged cache the continuous engine decodes on (PagedState, block pool)
    encoding.py   encoding in groups of similar length at CPU inference
    loss.py       the output layer and its loss in chunks, without the full logits
    int8.py       int8 linear layers for CPU decoding (runtime.precision=int8), tied output too
    compiled.py   the decoding step compiled ahead of time (runtime.compiled_step): the model's own
                  decode traced over the fast caches' buffers, kept on disk per model and CPU

Speed paths attach in two ways only. (1) Classes: `accelerate(model, runtime)` gives every module
whose class is a key of FAST_CLASSES its fast class, in place (same parameters, same state dict;
`adopt(runtime)` sets up a fast module's own state), and an attention variant a class derived from
FastMultiHeadAttention and the variant, which keeps every step the variant overrides;
runtime.precision=int8 then replaces linear layers by Int8Linear, as torch's quantized modules do,
and a tied output projection makes the model an Int8TiedOutput (int8.py). (2) Cache objects: the
decoding state a model makes (`new_state`) holds the caches its layers read and write: the
reference's KeyValueCache, FastKeyValueCache, or the engine's paged ones (paged.py). No fast path
copies a reference forward. runtime=reference (configs/runtime/) installs no class. One log line
per process says what was installed and why. docs/PERFORMANCE.md has what each
path is worth and where it was measured. The reference model never imports this package.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import Counter

from torch import nn

from ..model import DecoderLayer, Transformer
from ..model.attention import MultiHeadAttention, Rotary
from ..model.blocks import FeedForward
from ..runtime import RuntimeConfig
from .attention import FastMultiHeadAttention
from .dropout import FastDropout
from .int8 import quantize_int8
from .linear import FastLinear, bound_primitive_caches, refresh_packed_weights
from .model import FastDecoderLayer, FastFeedForward, FastRotary, FastTransformer

log = logging.getLogger(__name__)

# Each reference class and the fast class a module of exactly that class becomes.
FAST_CLASSES: dict[type, type] = {
    Transformer: FastTransformer,
    DecoderLayer: FastDecoderLayer,
    MultiHeadAttention: FastMultiHeadAttention,
    FeedForward: FastFeedForward,
    Rotary: FastRotary,
    nn.Linear: FastLinear,
    nn.Dropout: FastDropout,
}
# Reference classes whose subclasses (the attention variants of attention_variants.py) get a fast
# class too: derived from the fast class and the variant, with the variant's own steps kept.
VARIANT_BASES = (MultiHeadAttention,)
_VARIANT_CLASSES: dict[type, tuple[type, list[str]]] = {}


def fast_steps(fast: type) -> list[str]:
    """The methods a fast class overrides (adopt, which sets up its state, aside)."""
    return [name for name, member in vars(fast).items() if inspect.isfunction(member) and name != "adopt"]


def fast_class(cls: type) -> tuple[type | None, list[str]]:
    """(the fast class for modules of class `cls`, the steps kept from `cls` because it overrides
    them); (None, []) for a class without one (or already fast)."""
    if cls in FAST_CLASSES:
        return FAST_CLASSES[cls], []
    base = next((b for b in VARIANT_BASES if issubclass(cls, b)), None)
    fast = FAST_CLASSES.get(base)
    if base is None or issubclass(cls, fast):
        return None, []
    if cls not in _VARIANT_CLASSES:
        kept = [name for name in fast_steps(fast) if getattr(cls, name) is not getattr(base, name)]
        members = {name: inspect.getattr_static(cls, name) for name in kept}
        members["__doc__"] = f"{cls.__name__} with {fast.__name__}'s steps" + (f", except its own {', '.join(kept)}" if kept else "")  # fmt: skip
        _VARIANT_CLASSES[cls] = type(f"Fast{cls.__name__}", (fast, cls), members), kept
    return _VARIANT_CLASSES[cls]


def install(model: nn.Module, runtime: RuntimeConfig) -> tuple[Counter, list[str]]:
    """Every module of `model` with a fast class turned into it, in place; returns (how many
    modules became each fast class, the variants' steps that were kept)."""
    installed, kept = Counter(), []
    for module in model.modules():
        fast, own = fast_class(type(module))
        if fast is None:
            continue
        kept += [f"{type(module).__name__}.{name}" for name in own]
        module.__class__ = fast
        if hasattr(fast, "adopt"):
            module.adopt(runtime)
        installed[fast.__name__] += 1
    if runtime.onednn or runtime.onednn_inference:
        bound_primitive_caches()
    # After every optimizer step: fused Adam leaves the weights' version counters as they were, and
    # both packed weights (linear.py) and compiled programs (compiled.py) read them to see a change.
    refresh_packed_weights()
    return installed, list(dict.fromkeys(kept))


@functools.cache
def log_once(message: str) -> None:
    """Log `message` the first time it is given in this process (a process builds many models)."""
    log.info(message)


def accelerate(transformer, runtime: RuntimeConfig | None = None, int8: bool = False):
    """Install the speed paths `runtime` asks for on `transformer` (a Transformer, in place; the
    same parameters and state dict) and return it; runtime.fast=false installs none. int8=True
    (runtime.precision=int8, for decoding on a CPU) then quantizes its linear layers (fast/int8.py),
    under either runtime; a compiled decoding step calls the decoder's int8 layers (fast/compiled.py).
    Logs, once per process for each distinct line, what was installed and why."""
    runtime = runtime or RuntimeConfig()
    if not runtime.fast:
        log_once(runtime.describe())
    else:
        installed, kept = install(transformer, runtime)
        line = ", ".join(f"{name} x{count}" for name, count in installed.items())
        line += f"; kept the variants' own {', '.join(kept)}" if kept else ""
        log_once(f"{runtime.describe()} | installed {line}")
    if int8:
        quantize_int8(transformer, runtime.fast and runtime.onednn_inference)
    return transformer


__all__ = ["FAST_CLASSES", "accelerate", "fast_class", "install"]
