"""int8 decoding on CPU (runtime.precision=int8): every linear layer's weight quantized to int8 per
output channel once, its input quantized per row (per token) at each product, and the product
computed in int8 by oneDNN (`torch.ops.onednn.qlinear_pointwise`).

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

Why a check at start-up (`kernel_plan`): where the CPU lacks VNNI (AVX2, or
AVX-512 without VNNI), the kernels add pairs of u8 x s8 products in 16 bits, which saturates for
large weights and inputs: the product is silently wrong. The check multiplies the worst case
and compares with the exact integer result: where full-range weights are wrong, the weights
are quantized to [-63, 63], which cannot saturate; where those are wrong too, decoding stays in
fp32. Then each layer shape is timed: a shape whose int8 layer is slower than its fp32 one stays
fp32. A timing is taken once per machine and kept on disk (`plan_cache_path`, keyed by the CPU,
its instruction-set limits, torch and the shape), so a busy moment cannot change the choice from
one run to the next. The log says what was chosen, why, and where the timings are kept.

The output projection is int8 too, also where it is tied to the embeddings (an int8 copy; the
lookup stays fp32): it is the largest product of a decoding step. Norms, softmax and the
attention products stay fp32.
"""

from __future__ import annotations

import functools
import logging
import weakref
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


def available() -> bool:
    """Whether this torch build has oneDNN's quantized linear product."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def quantize_rows(x: Tensor, levels: int = ROW_SCALE) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row: x (rows, features) -> int8 values in [-levels, levels] and (rows, 1)
    scales, x ~ q * scale."""
    largest = x.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(x.dtype).tiny)
    return (x * (levels / largest)).round_().to(torch.int8), largest / levels


def quantize_inputs(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rows quantized as by quantize_rows, passed as u8 (q + ZERO_POINT), and their (rows, 1) scales.
    Through int8 and a flip of the sign bit (q + 128 as a byte), as float -> uint8 casts are slow."""
    q, scale = quantize_rows(x)
    return q.view(torch.uint8).bitwise_xor_(ZERO_POINT), scale


class SharedInputs:
    """The quantized input of the last int8 layer called, for the next one if it reads the same
    tensor (a self-attention's key and value projections read their query projection's input).
    The tensor is held by a weak reference and checked with its version, so an input changed in
    place or freed is quantized afresh."""

    def __init__(self):
        self.last: tuple | None = None

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor]:
        last = self.last  # read once: a server's threads may share the model
        if last is not None and last[0]() is x and last[1] == x._version:
            return last[2]
        quantized = quantize_inputs(x.reshape(-1, x.size(-1)).float())
        self.last = (weakref.ref(x), x._version, quantized)
        return quantized


def _product(q: Tensor, packed: Tensor, w_scale: Tensor, w_zero: Tensor) -> Tensor:
    """(q - ZERO_POINT) W^T, scaled by the weights' channel scales: (rows, out) in fp32."""
    return torch.ops.onednn.qlinear_pointwise(q, 1.0, ZERO_POINT, packed, w_scale, w_zero, None, 1.0, 0, torch.float32, "none", [], "")  # fmt: skip


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (one scale per output channel) and x quantized per row.
    weight_levels: the weights' largest int8 magnitude (127, or NARROW_WEIGHTS; see kernel_plan);
    inputs: the model's SharedInputs (each layer its own when not given)."""

    def __init__(self, linear: nn.Linear, weight_levels: int = ROW_SCALE, inputs: SharedInputs | None = None):
        super().__init__()
        self.in_features, self.out_features, self.weight_levels = linear.in_features, linear.out_features, weight_levels
        weight, w_scale = quantize_rows(linear.weight.detach().float(), weight_levels)
        self.register_buffer("w_scale", w_scale.flatten().contiguous())  # (out,)
        self.register_buffer("w_zero", torch.zeros(self.out_features, dtype=torch.int32))
        self.register_buffer("packed", torch.ops.onednn.qlinear_prepack(weight, None))  # oneDNN's layout
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.inputs = inputs or SharedInputs()

    def forward(self, x: Tensor) -> Tensor:
        q, scale = self.inputs(x)
        y = _product(q, self.packed, self.w_scale, self.w_zero)
        y = y * scale if self.bias is None else torch.addcmul(self.bias, y, scale)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@dataclass(frozen=True)
class Int8Plan:
    """What runtime.precision=int8 does with a layer shape on this CPU: weight_levels is None where
    it stays fp32; `reason` says why, or how much faster int8 was."""

    weight_levels: int | None
    reason: str
    timing: str = ""  # where the timing came from: "timed now" or "timed on DATE" (plan_cache_path)


def exact_products(weight_levels: int) -> bool:
    """Whether oneDNN's int8 product equals the exact integer product on the cases that saturate a
    16-bit sum of two u8 x s8 products: all inputs and weights at their extremes, of both signs."""
    signs = torch.tensor([1, -1, 1, -1])[:, None] * torch.tensor([1, 1, -1, -1])[None, :]
    x = torch.cat([torch.full((4, 64), ROW_SCALE), torch.randint(-ROW_SCALE, ROW_SCALE + 1, (4, 64))])
    x[:4] *= signs[0][:, None]
    w = torch.cat([torch.full((4, 64), weight_levels), torch.randint(-weight_levels, weight_levels + 1, (12, 64))])
    w[:4] *= signs[:, 0][:, None]
    packed = torch.ops.onednn.qlinear_prepack(w.to(torch.int8), None)
    got = _product((x + ZERO_POINT).to(torch.uint8), packed, torch.ones(len(w)), torch.zeros(len(w), dtype=torch.int32))
    return torch.equal(got.double(), x.double() @ w.double().t())


def int8_to_fp32_time(weight_levels: int, onednn: bool, shape: tuple[int, int] = (512, 2048)) -> float:
    """Time of an Int8Linear over that of the fp32 layer it replaces, for a (in, out) `shape`,
    at the rows of a beam search step."""
    torch.manual_seed(0)
    layer = nn.Linear(*shape)
    int8, packed = Int8Linear(layer, weight_levels), PackedWeight()
    x = torch.randn(256, shape[0])

    def int8_layer(x: Tensor) -> Tensor:
        int8.inputs.last = None  # each call quantizes its input, as each layer of a model does
        return int8(x)

    with torch.no_grad():
        return timings.seconds(int8_layer, x) / timings.seconds(
            lambda x: linear(x, layer.weight, layer.bias, packed, onednn=onednn), x
        )


@functools.cache
def exact_weight_levels() -> int | None:
    """The widest weight range (127, else NARROW_WEIGHTS) whose int8 products are exact on this
    CPU, checked once per process; None where neither is."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return next((n for n in (ROW_SCALE, NARROW_WEIGHTS) if exact_products(n)), None)


def plan_cache_path() -> Path:
    """The file of int8 timings (fast/timings.py). Deleting it times the layer shapes again."""
    return timings.timings_path("int8")


def timing_key(weight_levels: int, onednn: bool, shape: tuple[int, int]) -> str:
    """What a timing depends on: the machine (timings.machine_key), the fp32 path it is compared
    with, the weight range and the layer shape."""
    fp32 = "onednn" if onednn else "blas"
    return f"{timings.machine_key()} | {fp32} | {weight_levels} | {shape[0]}x{shape[1]}"


def kept_ratio(weight_levels: int, onednn: bool, shape: tuple[int, int]) -> tuple[float, str]:
    """int8_to_fp32_time for this machine, timed once and kept in plan_cache_path(); and where it
    came from."""
    return timings.kept("int8", timing_key(weight_levels, onednn, shape), lambda: int8_to_fp32_time(weight_levels, onednn, shape))  # fmt: skip


@functools.cache
def kernel_plan(onednn: bool = True, shape: tuple[int, int] = (512, 2048)) -> Int8Plan:
    """The weight range whose int8 products are exact here (checked once per process), and
    whether an int8 layer of that (in, out) `shape` is at least as fast as the fp32 one
    (`onednn`: runtime.onednn_linear's choice), timed once per machine (kept_ratio)."""
    if not available():
        return Int8Plan(None, "this torch has no oneDNN quantized linear product")
    levels = exact_weight_levels()
    if levels is None:
        return Int8Plan(None, "oneDNN's int8 product is not exact on this CPU")
    with torch.random.fork_rng():
        ratio, timing = kept_ratio(levels, onednn, shape)
    return Int8Plan(levels if ratio <= 1.0 else None, f"{shape[0]}x{shape[1]} took {ratio:.2f}x fp32's time", timing)


def describe(plans: dict[tuple[int, int], Int8Plan]) -> str:
    """One log line on what quantize_int8 chose for each layer shape, and why."""
    used = [plan.reason for plan in plans.values() if plan.weight_levels is not None]
    kept = [plan.reason for plan in plans.values() if plan.weight_levels is None]
    timings = sorted({plan.timing for plan in plans.values() if plan.timing})
    source = f" ({', '.join(timings)}; kept in {plan_cache_path()}, delete it to time again)" if timings else ""
    if not used:
        return f"decoding stays in fp32: {'; '.join(dict.fromkeys(kept))}{source}"
    line = f"layers in int8 on oneDNN where faster ({', '.join(used)})"
    line += f"; kept in fp32 where not ({', '.join(kept)})" if kept else ""
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
        layer = Int8Linear(rows, self.int8_output.weight_levels)
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


def quantize_int8(model: nn.Module, onednn: bool = True, keep: tuple[str, ...] = (), why: str = "") -> nn.Module:
    """Replace, in place, every nn.Linear of `model` (fast/linear.py's `FastLinear` included) by an
    Int8Linear (torch's convention for quantized modules), and make a Transformer with a tied
    output projection an Int8TiedOutput (the embedding lookup stays fp32): each layer whose shape
    kernel_plan finds exact and faster in int8 on this CPU; the others stay fp32, and the log says
    which and why. The layers under the submodules named in `keep` (e.g. "decoder_layers") stay
    fp32 whatever their plan; `why` is said for them in the log. Returns `model`."""
    if not available():
        raise RuntimeError("runtime.precision=int8 needs torch with oneDNN's quantized linear (torch.ops.onednn)")
    kept = tuple(f"{name}." for name in keep)
    layers = [
        (parent, name, child)
        for path, parent in model.named_modules()
        if not f"{path}.".startswith(kept)
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
            setattr(parent, name, Int8Linear(child, plan.weight_levels, inputs))
            if child is tied:
                model.__class__ = with_int8_output(type(model))
    if plans:
        fp32 = all(plan.weight_levels is None for plan in plans.values())
        line = describe(plans) + (f"; {', '.join(keep)} kept in fp32: {why}" if keep else "")
        log.log(logging.WARNING if fp32 else logging.INFO, "runtime.precision=int8: %s", line)
    return model
