"""int8 decoding on CPU (runtime.precision=int8): every linear layer's weight quantized to int8 per
output channel once, its input quantized per row (per token) at each product, and the product
computed in int8 by one of two kernels in torch, whichever is faster for the layer's shape on this
CPU: oneDNN's (`torch.ops.onednn.qlinear_pointwise`) or FBGEMM's
(`torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32`). Under AVX2, FBGEMM's was
the faster at 7 of 8 decoding shapes measured (within 5% at the eighth); with VNNI, oneDNN's is at
the largest shapes (docs/lab/2026-12-06-fbgemm-int8.md).

Why per row: torch's dynamic quantization (`quantize_dynamic`) quantizes a layer's whole input
with one scale per call, on 7 bits (reduce_range, for FBGEMM's kernels): the scale of a decoding
step is set by the largest value of any row of the batch (padding included), so a sentence's
output depended on the other sentences batched with it, and its small activations lost most of
their precision. Here each row is scaled to [-127, 127] by its own maximum, as CTranslate2 does.

Why unsigned activations: the weights are prepacked for inputs of type u8 with a zero point,
which is what the int8 dot products of x86 CPUs multiply (u8 x s8: VNNI, and AVX2's pairwise
products). oneDNN's fast kernels (AMX, AVX512-VNNI, AVX2) take that; given s8 inputs, every CPU
without AMX fell to oneDNN's reference kernel, hundreds of times slower than fp32. So a row
quantized to q in [-127, 127] is passed as q + 128 with zero point 128: the same product.

FBGEMM takes the same u8 rows with zero point 128: each row is divided by its largest magnitude
and passed in fp32 with the scale 1/127, which FBGEMM rounds to the same integers, and its fp32
output is multiplied back by that magnitude.

Why a check at start-up (`kernel_plan`): where the CPU lacks VNNI (AVX2, or
AVX-512 without VNNI), both kernels add pairs of u8 x s8 products in 16 bits, which saturates for
large weights and inputs: the product is silently wrong. The check multiplies the worst case on
each kernel and compares with the exact integer result: where full-range weights are wrong, the
weights are quantized to [-63, 63], which cannot saturate; where those are wrong too, that kernel
is not used. Then each layer shape is timed on each exact kernel: the faster one is used, and a
shape whose int8 layers are all slower than its fp32 one stays fp32. A timing is taken once per
machine and kept on disk (`plan_cache_path`, keyed by the CPU, its instruction-set limits, torch,
the shape and the kernel), so a busy moment cannot change the choice from one run to the next.
The log says what was chosen, why, and where the timings are kept.

The output projection is int8 too, also where it is tied to the embeddings (an int8 copy; the
lookup stays fp32): it is the largest product of a decoding step. Norms, softmax and the
attention products stay fp32.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..model import Transformer
from . import timings
from .linear import FastLinear, PackedWeight, linear

log = logging.getLogger(__name__)

ROW_SCALE = 127  # a row's largest magnitude maps to this int8 value
ZERO_POINT = 128  # inputs go to the product as u8: q + 128
NARROW_WEIGHTS = 63  # weights quantized to [-63, 63]: 2 * 255 * 63 < 2^15, no 16-bit saturation


# The int8 products kernel_plan chooses between, by layer shape, with their names for the log.
KERNELS = {"onednn": "oneDNN", "fbgemm": "FBGEMM"}


def kernel_available(kernel: str) -> bool:
    """Whether this torch build has that int8 product (KERNELS)."""
    if kernel == "onednn":
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")
    ops = ("linear_prepack", "linear_with_input_q_dq_qweight_dq_output_fp32")
    found = hasattr(torch, "quantize_per_channel") and all(hasattr(torch.ops.quantized, op) for op in ops)
    return found and "fbgemm" in torch.backends.quantized.supported_engines


def available() -> bool:
    """Whether this torch build has an int8 linear product (oneDNN's or FBGEMM's)."""
    return any(kernel_available(kernel) for kernel in KERNELS)


def row_magnitudes(x: Tensor) -> Tensor:
    """Each row's largest magnitude, (rows, 1), at least the dtype's smallest normal number."""
    return x.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(x.dtype).tiny)


def quantize_rows(x: Tensor, levels: int = ROW_SCALE) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row: x (rows, features) -> int8 values in [-levels, levels] and (rows, 1)
    scales, x ~ q * scale."""
    largest = row_magnitudes(x)
    return (x * (levels / largest)).round_().to(torch.int8), largest / levels


def quantize_inputs(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rows quantized as by quantize_rows, passed as u8 (q + ZERO_POINT), and their (rows, 1) scales.
    Through int8 and a flip of the sign bit (q + 128 as a byte), as float -> uint8 casts are slow."""
    q, scale = quantize_rows(x)
    return q.view(torch.uint8).bitwise_xor_(ZERO_POINT), scale


def normalize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """FBGEMM's input: each row divided by its largest magnitude, and those (rows, 1) magnitudes.
    FBGEMM quantizes it with the scale 1 / ROW_SCALE, as quantize_inputs does."""
    largest = row_magnitudes(x)
    return x / largest, largest


# What each kernel's product takes: (input, (rows, 1) scales its output is multiplied by).
PREPARE: dict[str, Callable[[Tensor], tuple[Tensor, Tensor]]] = {"onednn": quantize_inputs, "fbgemm": normalize_rows}


class SharedInputs:
    """The prepared input (PREPARE) of the last int8 layer called, for the next one if it reads the
    same tensor (a self-attention's key and value projections read their query projection's input).
    The tensor is held by a weak reference and checked with its version, so an input changed in
    place or freed is prepared afresh."""

    def __init__(self):
        self.last: tuple | None = None

    def __call__(self, x: Tensor, kernel: str = "onednn") -> tuple[Tensor, Tensor]:
        last = self.last  # read once: a server's threads may share the model
        if last is None or last[0]() is not x or last[1] != x._version:
            last = self.last = (weakref.ref(x), x._version, {})
        prepared = last[2]
        if kernel not in prepared:
            prepared[kernel] = PREPARE[kernel](x.reshape(-1, x.size(-1)).float())
        return prepared[kernel]


def _product(q: Tensor, packed: Tensor, w_scale: Tensor, w_zero: Tensor) -> Tensor:
    """oneDNN: (q - ZERO_POINT) W^T, scaled by the weights' channel scales: (rows, out) in fp32."""
    return torch.ops.onednn.qlinear_pointwise(q, 1.0, ZERO_POINT, packed, w_scale, w_zero, None, 1.0, 0, torch.float32, "none", [], "")  # fmt: skip


def _fbgemm_product(x: Tensor, packed, input_scale: float = 1 / ROW_SCALE) -> Tensor:
    """FBGEMM: x quantized as round(x / input_scale) + ZERO_POINT, times the packed int8 weights
    with their channel scales, all scaled by input_scale: (rows, out) in fp32."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, input_scale, ZERO_POINT, packed)


@contextlib.contextmanager
def quantized_engine(name: str):
    """torch's quantized engine set to `name` for the block (it picks the weights' packing)."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def fbgemm_prepack(weight: Tensor, w_scale: Tensor):
    """int8 `weight` (out, in) with its channel scales (out,), packed for FBGEMM's product. Through
    torch's quantized tensors, which torch has deprecated (its warning is silenced here): a torch
    without them has no FBGEMM kernel (kernel_available), and int8 runs on oneDNN alone."""
    zeros = torch.zeros(len(w_scale), dtype=torch.long)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
        quantized = torch.quantize_per_channel(weight.float() * w_scale[:, None], w_scale.double(), zeros, 0, torch.qint8)  # fmt: skip
    with quantized_engine("fbgemm"):
        return torch.ops.quantized.linear_prepack(quantized, None)


def scaled_back(y: Tensor, scale: Tensor, bias: Tensor | None, shape: torch.Size) -> Tensor:
    """A product's (rows, out) output times its rows' (rows, 1) scales, plus the bias, in the
    input's `shape` with the last dimension out."""
    y = y * scale if bias is None else torch.addcmul(bias, y, scale)
    return y.view(*shape[:-1], y.size(-1))


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (one scale per output channel) and x quantized per row.
    weight_levels: the weights' largest int8 magnitude (127, or NARROW_WEIGHTS; see kernel_plan);
    inputs: the model's SharedInputs (each layer its own when not given); kernel: whose product
    (KERNELS). Both kernels compute the same integer products of the same quantized rows."""

    def __init__(self, linear: nn.Linear, weight_levels: int = ROW_SCALE, inputs: SharedInputs | None = None, kernel: str = "onednn"):  # fmt: skip
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"int8 kernel {kernel!r} is not one of {tuple(KERNELS)}")
        self.in_features, self.out_features, self.weight_levels = linear.in_features, linear.out_features, weight_levels
        self.kernel = kernel
        weight, w_scale = quantize_rows(linear.weight.detach().float(), weight_levels)
        self.register_buffer("w_scale", w_scale.flatten().contiguous())  # (out,)
        if kernel == "onednn":
            self.register_buffer("w_zero", torch.zeros(self.out_features, dtype=torch.int32))
            self.register_buffer("packed", torch.ops.onednn.qlinear_prepack(weight, None))  # oneDNN's layout
        else:
            self.fbgemm_packed = fbgemm_prepack(weight, self.w_scale)  # FBGEMM's packed weights (not a tensor)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.inputs = inputs or SharedInputs()

    def forward(self, x: Tensor) -> Tensor:
        prepared, scale = self.inputs(x, self.kernel)
        return scaled_back(self.product(prepared), scale, self.bias, x.shape)

    def product(self, prepared: Tensor) -> Tensor:
        """The kernel's product of inputs prepared for it (PREPARE) with the weights, in their
        channel scales: (rows, out) in fp32, to be multiplied by the rows' scales."""
        if self.kernel == "onednn":
            return _product(prepared, self.packed, self.w_scale, self.w_zero)
        return _fbgemm_product(prepared, self.fbgemm_packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, kernel={self.kernel}"  # fmt: skip


@dataclass(frozen=True)
class Int8Plan:
    """What runtime.precision=int8 does with a layer shape on this CPU: weight_levels is None where
    it stays fp32; `reason` says why, or how much faster int8 was."""

    weight_levels: int | None
    reason: str
    timing: str = ""  # where the timings came from: "timed now" or "timed on DATE" (plan_cache_path)
    kernel: str = "onednn"  # the faster exact int8 product (KERNELS)


def exact_products(weight_levels: int, kernel: str = "onednn") -> bool:
    """Whether `kernel`'s int8 product equals the exact integer product on the cases that saturate a
    16-bit sum of two u8 x s8 products: all inputs and weights at their extremes, of both signs."""
    signs = torch.tensor([1, -1, 1, -1])[:, None] * torch.tensor([1, 1, -1, -1])[None, :]
    x = torch.cat([torch.full((4, 64), ROW_SCALE), torch.randint(-ROW_SCALE, ROW_SCALE + 1, (4, 64))])
    x[:4] *= signs[0][:, None]
    w = torch.cat([torch.full((4, 64), weight_levels), torch.randint(-weight_levels, weight_levels + 1, (12, 64))])
    w[:4] *= signs[:, 0][:, None]
    ones = torch.ones(len(w))
    if kernel == "onednn":
        packed = torch.ops.onednn.qlinear_prepack(w.to(torch.int8), None)
        got = _product((x + ZERO_POINT).to(torch.uint8), packed, ones, torch.zeros(len(w), dtype=torch.int32))
    else:  # input scale 1: FBGEMM quantizes the integers to themselves
        got = _fbgemm_product(x.float(), fbgemm_prepack(w.to(torch.int8), ones), input_scale=1.0)
    return torch.equal(got.double(), x.double() @ w.double().t())


def int8_to_fp32_time(weight_levels: int, onednn: bool, shape: tuple[int, int] = (512, 2048), kernel: str = "onednn") -> float:  # fmt: skip
    """Time of an Int8Linear on `kernel` over that of the fp32 layer it replaces, for a (in, out)
    `shape`, at the rows of a beam search step."""
    torch.manual_seed(0)
    layer = nn.Linear(*shape)
    int8, packed = Int8Linear(layer, weight_levels, kernel=kernel), PackedWeight()
    x = torch.randn(256, shape[0])

    def int8_layer(x: Tensor) -> Tensor:
        int8.inputs.last = None  # each call quantizes its input, as each layer of a model does
        return int8(x)

    with torch.no_grad():
        return timings.time_ratio(int8_layer, lambda x: linear(x, layer.weight, layer.bias, packed, onednn=onednn), x)


@functools.cache
def exact_weight_levels(kernel: str = "onednn") -> int | None:
    """The widest weight range (127, else NARROW_WEIGHTS) whose int8 products on `kernel` are exact
    on this CPU, checked once per process; None where neither is, or this torch lacks the kernel."""
    if not kernel_available(kernel):
        return None
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return next((n for n in (ROW_SCALE, NARROW_WEIGHTS) if exact_products(n, kernel)), None)


def plan_cache_path() -> Path:
    """The file of int8 timings (fast/timings.py). Deleting it times the layer shapes again."""
    return timings.timings_path("int8")


def timing_key(weight_levels: int, onednn: bool, shape: tuple[int, int], kernel: str = "onednn") -> str:
    """What a timing depends on: the machine (timings.machine_key), the threads, the fp32 path it is
    compared with, the weight range, the layer shape and the int8 kernel."""
    fp32 = "onednn" if onednn else "blas"
    product = f"{fp32} | {weight_levels} | {shape[0]}x{shape[1]} | {kernel}"
    return f"{timings.machine_key()} | {timings.threads_key()} | {product}"


def kept_ratio(weight_levels: int, onednn: bool, shape: tuple[int, int], kernel: str = "onednn") -> tuple[float, str]:
    """int8_to_fp32_time for this machine, timed once and kept in plan_cache_path(); and where it
    came from."""
    key = timing_key(weight_levels, onednn, shape, kernel)
    return timings.kept("int8", key, lambda: int8_to_fp32_time(weight_levels, onednn, shape, kernel))


@functools.cache
def kernel_plan(onednn: bool = True, shape: tuple[int, int] = (512, 2048)) -> Int8Plan:
    """For each int8 kernel (KERNELS), the weight range whose products are exact here (checked once
    per process) and the time of an int8 layer of that (in, out) `shape` over the fp32 one's
    (`onednn`: runtime.onednn_linear's choice), timed once per machine (kept_ratio); the fastest
    kernel where it is at least as fast as fp32."""
    timed, unusable = [], []
    with torch.random.fork_rng():
        for kernel, name in KERNELS.items():
            levels = exact_weight_levels(kernel)  # None also where this torch lacks the kernel
            if not kernel_available(kernel):
                unusable.append(f"this torch has no {name} int8 product")
            elif levels is None:
                unusable.append(f"{name}'s int8 product is not exact on this CPU")
            else:
                timed.append((*kept_ratio(levels, onednn, shape, kernel), kernel, levels))
    if not timed:
        return Int8Plan(None, "; ".join(unusable))
    timed.sort(key=lambda t: (t[0], list(KERNELS).index(t[2])))  # the faster; oneDNN on a tie
    ratio, _, kernel, levels = timed[0]
    ratios = ", ".join(f"{KERNELS[k]} {r:.2f}x" for r, _, k, _ in timed)
    timing = ", ".join(sorted({t[1] for t in timed}))
    reason = f"{shape[0]}x{shape[1]} took {ratios} fp32's time" + (f" ({'; '.join(unusable)})" if unusable else "")
    return Int8Plan(levels if ratio <= 1.0 else None, reason, timing, kernel)


def describe(plans: dict[tuple[int, int], Int8Plan]) -> str:
    """One log line on what quantize_int8 chose for each layer shape, and why."""
    used = [f"{plan.reason}: {KERNELS[plan.kernel]}" for plan in plans.values() if plan.weight_levels is not None]
    kept = [plan.reason for plan in plans.values() if plan.weight_levels is None]
    timings = sorted({t for plan in plans.values() if plan.timing for t in plan.timing.split(", ")})
    source = f" ({', '.join(timings)}; kept in {plan_cache_path()}, delete it to time again)" if timings else ""
    if not used:
        return f"decoding stays in fp32: {'; '.join(dict.fromkeys(kept))}{source}"
    line = f"layers in int8 on the faster kernel where int8 is faster ({'; '.join(used)})"
    line += f"; kept in fp32 where not ({'; '.join(kept)})" if kept else ""
    if any(plan.weight_levels == NARROW_WEIGHTS for plan in plans.values()):
        line += f"; weights in [-{NARROW_WEIGHTS}, {NARROW_WEIGHTS}]: this CPU's int8 product saturates full-range ones"
    return line + source


class Int8TiedOutput:
    """A Transformer whose tied output projection runs in int8: `int8_output`, an Int8Linear made
    from the embedding matrix (the lookup stays fp32). `output` stays None, as the tying says."""

    int8_output: Int8Linear

    def project(self, x: Tensor) -> Tensor:
        logits = self.int8_output(x)
        return logits if self.logits_bias is None else logits + self.logits_bias

    def vocabulary_projection(self, ids: Tensor):
        """The rows `ids` of the int8 projection, quantized for the batch as the whole one is (one
        scale per row, so each logit is the whole projection's)."""
        weight, bias = self.vocabulary_rows(ids)  # the tied embedding's rows: output_weight
        rows = nn.Linear(self.cfg.d_model, len(ids), bias=False)
        rows.weight = nn.Parameter(weight, requires_grad=False)
        layer = Int8Linear(rows, self.int8_output.weight_levels, kernel=self.int8_output.kernel)
        return layer if bias is None else (lambda x: layer(x) + bias)


@functools.cache
def with_int8_output(cls: type) -> type:
    """`cls` (a Transformer class, fast or reference) with Int8TiedOutput's projection."""
    return type(f"Int8Output{cls.__name__}", (Int8TiedOutput, cls), {"__doc__": f"{cls.__name__} with an int8 tied output projection"})  # fmt: skip


def tied_projection(model: nn.Module) -> nn.Linear | None:
    """A Transformer's tied output projection as a linear layer (its weight the embedding's), or None."""
    if not isinstance(model, Transformer) or model.output is not None:
        return None
    projection = nn.Linear(model.cfg.d_model, model.embed.embed.num_embeddings, bias=False)
    projection.weight = model.embed.embed.weight
    return projection


def quantize_int8(model: nn.Module, onednn: bool = True) -> nn.Module:
    """Replace, in place, every nn.Linear of `model` (fast/linear.py's `FastLinear` included) by an
    Int8Linear (torch's convention for quantized modules), and make a Transformer with a tied
    output projection an Int8TiedOutput (the embedding lookup stays fp32): each layer whose shape
    kernel_plan finds exact and faster in int8 on this CPU; the others stay fp32, and the log says
    which and why. Returns `model`."""
    if not available():
        raise RuntimeError("runtime.precision=int8 needs torch with oneDNN's or FBGEMM's quantized linear")
    layers = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, FastLinear)
    ]
    tied = tied_projection(model)
    if tied is not None:
        layers.append((model, "int8_output", tied))
    plans = {shape: kernel_plan(onednn, shape) for shape in sorted({(c.in_features, c.out_features) for _, _, c in layers})}  # fmt: skip
    inputs = SharedInputs()
    for parent, name, child in layers:
        plan = plans[child.in_features, child.out_features]
        if plan.weight_levels is not None:
            setattr(parent, name, Int8Linear(child, plan.weight_levels, inputs, plan.kernel))
            if child is tied:
                model.__class__ = with_int8_output(type(model))
    if plans:
        fp32 = all(plan.weight_levels is None for plan in plans.values())
        log.log(logging.WARNING if fp32 else logging.INFO, "runtime.precision=int8: %s", describe(plans))
    return model
