"""Linear layers whose fp32 products on CPU run on oneDNN (replaces nn.Linear's forward).

torch computes an fp32 `F.linear` on CPU with its BLAS library (MKL in the x86 wheels) and a bf16
one with oneDNN; on some CPUs oneDNN's fp32 kernels are much faster (docs/PERFORMANCE.md). So
`linear` sends CPU fp32 products to oneDNN:

- in training, through `_OneDNNLinear`, whose backward is two more oneDNN products
  (dX = dY W and dW = dY^T X) and a sum for the bias; dW goes to BLAS when dY is large (the
  output layer's), where copying the transposes oneDNN needs costs more than its product saves;
- in inference (no gradients), with the weight reordered once into oneDNN's blocked layout
  (`PackedWeight`), or on BLAS, whichever ran faster on this machine for the product's shape and
  rows (`by_rows`, below).

Inference under CPU bf16 autocast takes the same packed path with a bf16 copy of the weight,
reordered once: under autocast `F.linear` hands oneDNN the plain bf16 weight, which oneDNN
reorders again at every product. Everything else (GPUs, bf16 training, torch.compile, other
dtypes) takes `F.linear` unchanged. `FastLinear` is `nn.Linear` with this forward: same parameters,
same state dict; `transformer.fast.accelerate` turns a model's nn.Linear layers into it. By
default products without gradients choose by rows on every CPU and products with gradients take
oneDNN only where AVX-512 runs (transformer/runtime.py); runtime.onednn_linear=true keeps both on
oneDNN, false both on F.linear.

oneDNN builds a primitive for every product shape and keeps up to 1024 of them in two caches
(its own and that of ideep, torch's wrapper), with buffers of several MB each; training batches
come in many shapes, so with those defaults a process grows with every new one.
`bound_primitive_caches` (called by `accelerate`) bounds both at `CACHE_CAPACITY` entries, unless
the environment already sets them: it takes effect before oneDNN's first product in a process.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import timings

log = logging.getLogger(__name__)

CACHE_CAPACITY = 16
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's own cache, ideep's
AVAILABLE = torch.backends.mkldnn.is_available()
_BF16_SUPPORTED = AVAILABLE and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bound_primitive_caches() -> list[str]:
    """Bound oneDNN's and ideep's primitive caches at CACHE_CAPACITY entries where the environment
    does not set them; returns the variables set."""
    unset = [v for v in CACHE_VARIABLES if v not in os.environ]
    for variable in unset:
        os.environ[variable] = str(CACHE_CAPACITY)
    return unset


TRANSPOSE_LIMIT = 2**23  # elements of dY (32 MB in fp32) above which dW = dY^T X goes to BLAS


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}  # those oneDNN can apply inside the product
ONEDNN_NAMES = {"silu": "swish"}  # oneDNN's name where it differs from torch's


def _product(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None = None) -> Tensor:
    """activation(x W^T + b) by oneDNN; weight is (out, in), plain or reordered by PackedWeight."""
    name = ONEDNN_NAMES.get(activation, activation) or "none"
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, name, [], "none" if activation else "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad2d, x2d = grad.reshape(-1, grad.size(-1)), x.reshape(-1, x.size(-1))
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(grad2d, weight.t(), None).view(x.shape)  # dY W, as a product with W^T's rows
        if ctx.needs_input_grad[1]:
            # dY^T X. oneDNN's product wants both operands transposed into new copies, which for a
            # large dY (the output layer's, rows x vocabulary) costs more than the product saves;
            # BLAS reads the transposes in place.
            big = grad2d.numel() > TRANSPOSE_LIMIT
            grad_w = grad2d.t() @ x2d if big else _product(grad2d.t(), x2d.t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2d.sum(0)
        return grad_x, grad_w, grad_b


class PackedWeight:
    """A weight reordered for oneDNN, for inference, in fp32 and/or bf16 (with the bias in the same
    dtype); reordered again whenever the weight or bias changes (an optimizer step or
    load_state_dict bumps its version). by_rows: an fp32 product takes the packed weight only at
    the row counts where that ran faster than BLAS on this machine (`by_rows`)."""

    def __init__(self, by_rows: bool = False):
        self.entries: dict[torch.dtype, tuple[tuple, Tensor, Tensor | None]] = {}
        self.by_rows = by_rows

    def get(self, weight: Tensor, bias: Tensor | None = None, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        key = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in (weight, bias) if t is not None)
        entry = self.entries.get(dtype)
        if entry is None or entry[0] != key:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype))
            entry = (key, packed, None if bias is None else bias.detach().to(dtype))
            self.entries[dtype] = entry
        return entry[1], entry[2]

    def __getstate__(self) -> dict:  # copies and pickles start without the oneDNN tensors
        return {"by_rows": self.by_rows}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.get("by_rows", False))


def _use_onednn(x: Tensor, weight: Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


def _packs_bf16(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Inference under CPU bf16 autocast, which the packed bf16 weight can serve."""
    return (  # the autocast check first: fp32 training and inference leave at it
        _BF16_SUPPORTED
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == torch.float32
        and x.numel() > 0
        and not _needs_grad(x, weight, bias)
        and not torch.compiler.is_compiling()
    )


def _needs_grad(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))  # fmt: skip


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    packed: PackedWeight | None = None,
    activation: str | None = None,
    onednn: bool = True,
) -> Tensor:
    """F.linear(x, weight, bias), on oneDNN for CPU fp32; `packed` caches the reordered weight
    for inference, in bf16 too for inference under CPU bf16 autocast. `activation` ("relu",
    "gelu" or "silu") is applied to the result: at inference on oneDNN inside the product, which saves a
    pass over the output. onednn=False: F.linear and the activation, always."""
    if not (onednn and AVAILABLE):
        return _blas(x, weight, bias, activation)
    if packed is not None and _packs_bf16(x, weight, bias):
        packed_weight, packed_bias = packed.get(weight, bias, torch.bfloat16)
        return _product(x.to(torch.bfloat16), packed_weight, packed_bias, activation)
    if not _use_onednn(x, weight):
        return _blas(x, weight, bias, activation)
    if _needs_grad(x, weight, bias):
        return _activate(_OneDNNLinear.apply(x, weight, bias), activation)
    if packed is not None and packed.by_rows:
        return by_rows(x, weight, bias, packed, activation)
    if packed is not None:
        weight, bias = packed.get(weight, bias)
    return _product(x, weight, bias, activation)


# --- Packed oneDNN or BLAS, by rows -------------------------------------------------------------
# A packed oneDNN product costs some 25-35 us per call beyond its kernel (torch's and ideep's
# wrappers; on an Ice Lake Xeon the kernel of a 5 x 256 x 256 product takes 7 us of a 39 us call),
# and BLAS far less: at the few rows of one sentence's decoding step BLAS is 2-4x faster, at tens
# to hundreds of rows either may be (docs/PERFORMANCE.md). Timed alone, in a loop, a product can
# also rank the two otherwise than inside a decoding run (2x apart on that Xeon at 16 rows). So
# each (rows, in, out), the rows rounded up to a power of two (at most ROWS_TIMED), is timed in use:
# its first 2 * SAMPLES products alternate between the two, and the faster median decides, kept on
# disk for every later run on the machine (fast/timings.py).
ROWS_TIMED = 256
SAMPLES = 8
_CHOICES: dict[tuple[int, int, int], bool] = {}  # decided: True for packed oneDNN
_TRIALS: dict[tuple[int, int, int], tuple[list[float], list[float]]] = {}  # being timed: packed, BLAS seconds
_clock = time.perf_counter


def rows_bucket(rows: int) -> int:
    """The row count a product of `rows` rows is decided at: the next power of two, at most ROWS_TIMED."""
    return min(1 << max(rows - 1, 0).bit_length(), ROWS_TIMED)


def timing_key(key: tuple[int, int, int]) -> str:
    return f"{timings.machine_key()} | {timings.threads_key()} | {key[0]}x{key[1]}x{key[2]}"


def by_rows(x: Tensor, weight: Tensor, bias: Tensor | None, packed: PackedWeight, activation: str | None) -> Tensor:
    """An fp32 inference product on packed oneDNN or on BLAS, as decided for its rows and shape,
    or while that is being timed, on the one of the two that has been timed less."""
    key = (rows_bucket(x.numel() // x.size(-1)), weight.size(1), weight.size(0))
    choice = _CHOICES.get(key)
    if choice is None and key not in _TRIALS:
        tell_once()
        ratio = timings.read("fp32_linear", timing_key(key))
        if ratio is None:
            _TRIALS[key] = ([], [])
        else:
            choice = _CHOICES[key] = ratio <= 1.0
    if choice is not None:
        return _product(x, *packed.get(weight, bias), activation) if choice else _blas(x, weight, bias, activation)
    packed_seconds, blas_seconds = _TRIALS[key]
    on_packed = len(packed_seconds) <= len(blas_seconds)
    start = _clock()
    out = _product(x, *packed.get(weight, bias), activation) if on_packed else _blas(x, weight, bias, activation)
    (packed_seconds if on_packed else blas_seconds).append(_clock() - start)
    if len(blas_seconds) == SAMPLES:
        decide(key, statistics.median(packed_seconds) / statistics.median(blas_seconds))
    return out


@functools.cache
def tell_once() -> None:
    log.info(
        "fp32 products at inference: packed on oneDNN or on BLAS by shape and row count, whichever ran "
        "faster in their first products on this machine (each choice kept in %s; delete it to time again)",
        timings.timings_path("fp32_linear"),
    )


def decide(key: tuple[int, int, int], ratio: float) -> None:
    _CHOICES[key] = ratio <= 1.0
    _TRIALS.pop(key, None)
    timings.keep("fp32_linear", timing_key(key), ratio)
    log.debug("%d x %d -> %d: packed oneDNN took %.2fx BLAS's time: %s", *key, ratio, "oneDNN" if ratio <= 1.0 else "BLAS")  # fmt: skip


def _blas(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    """F.linear and the activation after it: torch's BLAS for CPU fp32."""
    return _activate(F.linear(x, weight, bias), activation)


def onednn_now(training: bool, inference: bool) -> bool:
    """Whether a product runs on oneDNN now: the `inference` choice where no gradient is
    recorded, the `training` one where it is (runtime.onednn and runtime.onednn_inference)."""
    return training if torch.is_grad_enabled() else inference


def _activate(x: Tensor, activation: str | None) -> Tensor:
    return x if activation is None else ACTIVATIONS[activation](x)


class FastLinear(nn.Linear):
    """nn.Linear computed by `linear`."""

    def __init__(self, *args, onednn: bool = True, onednn_inference: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed, self.onednn, self.onednn_inference = PackedWeight(), onednn, onednn_inference

    def adopt(self, runtime) -> None:
        """State for a layer that was an nn.Linear (runtime.onednn, runtime.onednn_inference: where
        products with and without gradients run, False meaning F.linear; runtime.inference_by_rows:
        packed or BLAS at inference by the rows of each product)."""
        self.packed, self.onednn, self.onednn_inference = PackedWeight(runtime.inference_by_rows), runtime.onednn, runtime.onednn_inference  # fmt: skip

    def forward(self, x: Tensor, activation: str | None = None) -> Tensor:
        onednn = onednn_now(self.onednn, self.onednn_inference)
        return linear(x, self.weight, self.bias, self.packed, activation, onednn)


def bump_fused_versions(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """torch's fused Adam updates the weights without bumping their version counters, and
    `PackedWeight` keeps its reordered copy until the version changes: after each step of a fused
    parameter group, bump them, so that inference (validation) sees the new weights. Installed
    for every optimizer of the process by `refresh_packed_weights` (a global step hook)."""
    # Per group: a resumed optimizer takes its groups' settings, "fused" too, from the checkpoint.
    fused = [p for group in optimizer.param_groups if group.get("fused") for p in group["params"]]
    if fused:
        torch.autograd.graph.increment_version(fused)


_REFRESH_HOOK = []


def refresh_packed_weights() -> None:
    """Install `bump_fused_versions` after every optimizer step in this process, once."""
    if not _REFRESH_HOOK:
        _REFRESH_HOOK.append(register_optimizer_step_post_hook(bump_fused_versions))
