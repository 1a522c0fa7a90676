"""A compiled decoding step: the model's own `decode` for one new token, traced by torch.export
over the fast runtime's caches and compiled ahead of time by AOTInductor into a shared library,
kept on disk per model and CPU (runtime.compiled_step).

Why: a decoding step of a small model on few rows (one sentence, greedy or beam 5) is mostly
operator calls, not arithmetic; compiled, its hundreds of calls become a few fused C++ loops
(about 2x faster for one sentence; with many rows the products dominate and it gains 15-25%,
docs/PERFORMANCE.md).

What is traced: a reference Transformer with the same weights whose decoder layers fold each
sentence's beams into one cross-attention query (FastDecoderLayer) and attend as two batched
products (FastMultiHeadAttention: 5-10% faster compiled than the fused kernel at 5-1,000 rows),
decoding one token into
`BufferCache`s: the self-attention keys and values written in place at the step's position of
the buffers the fast runtime's FastKeyValueCache already keeps (fast/cache.py: GrowingCache), the
slots past it masked. So the compiled program reads and writes the same caches as the eager
step: the first step (which stores the encoder's keys and values) and any step the program does
not take run eagerly on the same state. The program returns the decoder's normalized output; the
output layer (packed, int8, shortlisted) stays the fast model's own.

Where the program's fp32 products run (`products`, one log line): on AMD (and Hygon) CPUs the
weights are packed for oneDNN inside the program (Inductor's freezing), because there MKL, the
BLAS of torch's x86 wheels, runs its generic kernels (mkl_blas_def_*); on a Zen 5 that made the
program 1.01-1.25x faster, natively and under AVX2. Elsewhere (Intel CPUs, where the program was
timed on MKL, and CPUs whose vendor is not read) the products stay on torch's BLAS as traced.

int8 decoder layers (runtime.precision=int8) are traced as int8_call.Int8Call: the input's preparation
and the output's scaling are in the program, and the product is the operator
transformer::int8_product, which runs the layer of that name of the model whose step is running
(FBGEMM's packed weights are no tensor a program could hold). So a kept program serves any model
with the same fp32 weights and int8 layers, kernels included.

Two programs per model and CPU: one for one row per sentence (greedy search, sampling) and one
for several (beam search), each for any number of sentences, source length and cache capacity.
They are kept in the cache directory of fast/timings.py under a key naming the weights, the
model's configuration, the code they are traced from (every file of the model and fast packages),
the CPU and its limits, torch and the thread count.

A program holds the weights it was compiled with (Inductor folds them into it: the oneDNN
packing needs them as constants). So a model whose step weights change after its programs were
found (an optimizer step, a checkpoint loaded into it, a quantization) finds the programs of its
new weights before its next batch, kept or compiled, or decodes eagerly: `CompiledStep` reads each
weight's place and version counter at every new decoding state (microseconds; the fused
optimizer's steps bump the counters too, fast/linear.py) and, where they moved, the weights' digest.

runtime.compiled_step: null (the default) uses a program already kept and never compiles; true
compiles a missing one (about 25 s per program with a C++ compiler; without one, the
eager step, logged); false never uses one. Loading a kept program needs no compiler. One log
line per process says which ran and why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
import weakref
import zlib
from pathlib import Path

import torch
from torch import Tensor, nn

from ..devices import cpu_info
from ..model import DecoderState, LayerCache, Transformer
from ..model.attention import MultiHeadAttention
from ..model.cache import KeyValueCache
from . import timings
from .attention import FastMultiHeadAttention
from .cache import FastKeyValueCache
from .int8_call import Int8Call, int8_layers, products_of
from .timings import cache_dir, machine_key

log = logging.getLogger(__name__)


MAX_WIDTH = 16  # the most rows per sentence (beams) a program takes: attention as two products up to 16 queries


@functools.cache
def log_once(message: str) -> None:
    log.info(message)


# --- What is traced ------------------------------------------------------------------------------


class BufferCache(KeyValueCache):
    """A self-attention cache over given buffers (rows, kv_heads, capacity, head_size): a step's keys
    and values are written at `position`, and attention reads the whole buffers with the slots
    past it masked."""

    def __init__(self, keys: Tensor, values: Tensor, position: Tensor):
        super().__init__()
        self.keys, self.values, self.position = keys, values, position

    def positions(self) -> Tensor:
        return self.position

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.keys.index_copy_(2, self.position, k)
        self.values.index_copy_(2, self.position, v)
        filled = torch.arange(self.keys.size(2), device=k.device) <= self.position
        return self.keys, self.values, filled.view(1, 1, 1, -1)


class TracedState(DecoderState):
    """The decoding state of one traced step: every row at `position`, a (1,) tensor."""

    def __init__(self, position: Tensor, layers: list[LayerCache]):
        super().__init__(layers=layers)
        self.position = position

    def positions(self) -> Tensor:
        return self.position

    def advance(self, tokens: int) -> None:
        pass


class Step(nn.Module):
    """One decoding step of `model` as a function of tensors, for torch.export: tokens (sentences,
    width) -> the decoder's normalized output (sentences * width, 1, d_model), writing this step's
    keys and values into the self-attention buffers (sentences, width, kv_heads, capacity, head_size)."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens, position, src_mask, self_keys, self_values, cross_keys, cross_values):
        layers = [LayerCache(BufferCache(k.flatten(0, 1), v.flatten(0, 1), position), KeyValueCache()) for k, v in zip(self_keys, self_values)]  # fmt: skip
        for layer, k, v in zip(layers, cross_keys, cross_values):
            layer.cross.store(k, v)  # the encoder's keys and values, as the eager first step stored them
        state = TracedState(position, layers)
        hidden, _ = self.model.decode(tokens.flatten(0, 1)[:, None], None, src_mask, state, project=False)
        return hidden


def step_weights(model: Transformer) -> dict[str, Tensor]:
    """The parameters and buffers a program holds: the model's state without the encoder's,
    without an int8 output layer's (it runs eagerly after the step), and of the decoder's int8
    layers their bias alone (the program calls them for their products: int8_call.Int8Call)."""
    called = tuple(f"{name}." for name in int8_layers(model.decoder_layers, "decoder_layers"))
    return {
        k: v
        for k, v in model.state_dict().items()
        if not k.startswith(("encoder_layers.", "src_embed.", "int8_output."))
        and (not k.startswith(called) or k.endswith(".bias"))
    }


def traced_model(model: Transformer, decoder_layer: type) -> Transformer:
    """A reference Transformer with `model`'s decoding weights whose decoder layers are of the fast
    class `decoder_layer` (FastDecoderLayer: beams folded), and whose layers that are int8 in
    `model` call them by name (int8_call.Int8Call); without an encoder, which a step does not run."""
    reference = Transformer(model.cfg)
    for name, layer in int8_layers(model.decoder_layers, "decoder_layers").items():
        parent, child = name.rsplit(".", 1)
        setattr(reference.get_submodule(parent), child, Int8Call(layer, name))
    missing, unexpected = reference.load_state_dict(step_weights(model), strict=False)
    if unexpected or any(not k.startswith(("encoder_layers.", "src_embed.")) for k in missing):
        raise ValueError(f"the decoding step's weights do not match the model's: {missing + unexpected}")
    for layer in reference.decoder_layers:
        layer.__class__ = decoder_layer
        for attention in (layer.self_attn, layer.cross_attn):
            attention.__class__ = FastMultiHeadAttention  # attention as two products for a step's few queries
    reference.encoder_layers, reference.src_embed = nn.ModuleList(), None
    return reference.eval()


def example(model: Transformer, width: int) -> tuple:
    """Inputs of the shapes a step takes: 3 sentences of `width` rows, 7 source tokens, capacity 16."""
    cfg, n = model.cfg, len(model.decoder_layers)
    sentences, src_len, capacity = 3, 7, 16
    buffers = [torch.zeros(sentences, width, cfg.kv_heads, capacity, cfg.head_size) for _ in range(2 * n)]
    memory = [torch.zeros(sentences, cfg.kv_heads, src_len, cfg.head_size) for _ in range(2 * n)]
    tokens = torch.ones(sentences, width, dtype=torch.long)
    src_mask = torch.ones(sentences, 1, 1, src_len, dtype=torch.bool)
    return tokens, torch.tensor([1]), src_mask, buffers[:n], buffers[n:], memory[:n], memory[n:]


def products() -> tuple[str, str]:
    """Where a program's fp32 products run, "onednn" (weights packed inside the program) or
    "blas" (MKL, as traced), and why, by the CPU's vendor."""
    vendor = cpu_info("vendor_id", "unknown")
    if vendor in ("AuthenticAMD", "HygonGenuine"):
        return "onednn", f"{vendor}: MKL, torch's BLAS, runs its generic kernels on this CPU"
    return "blas", f"{vendor}: as traced"


def compile_step(model: Transformer, width: int, path: Path, decoder_layer: type, library: str = "blas") -> None:
    """Export `model`'s step for one row per sentence (width 1) or several (width 2: any beam) and
    compile it with AOTInductor into the package `path`, its fp32 products on `library` (products)."""
    from torch.export import Dim

    n = len(model.decoder_layers)
    sentences, source, capacity = Dim("sentences", max=4096), Dim("source", max=4096), Dim("capacity", max=4096)
    rows = (
        {0: sentences, 3: capacity}
        if width == 1
        else {0: sentences, 1: Dim("width", min=2, max=MAX_WIDTH), 3: capacity}
    )
    memory = {0: sentences, 2: source}
    tokens = {0: sentences} if width == 1 else {0: sentences, 1: rows[1]}
    dynamic = (tokens, None, {0: sentences, 3: source}, [rows] * n, [rows] * n, [memory] * n, [memory] * n)
    with torch.no_grad():
        program = torch.export.export(
            Step(traced_model(model, decoder_layer)),
            example(model, width),
            dynamic_shapes=dynamic,
            prefer_deferred_runtime_asserts_over_guards=True,  # checks at run time what the tracer cannot prove
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    with torch._inductor.config.patch(freezing=library == "onednn"):  # freezing packs the weights for oneDNN
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
    os.replace(partial, path)


def load_program(path: Path):
    """The compiled package at `path` as a function of its flattened inputs. torch's loader class is
    used directly: the public torch._inductor.aoti_load_package imports the compiler first (1 s)."""
    loader = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader is not None:
        try:
            return loader(str(path), "model", False, 1, -1).run
        except TypeError:  # another torch's signature
            pass
    package = torch._inductor.aoti_load_package(str(path))
    return lambda inputs: [package(*inputs)]


# --- Choosing and running it ---------------------------------------------------------------------


def compiler() -> str | None:
    """The C++ compiler AOTInductor would call ($CXX, else g++), or None where there is none."""
    return shutil.which(os.environ.get("CXX") or "g++")


def unsupported(model: Transformer, decoder_layer: type) -> str | None:
    """Why the fast `model` has no compiled step (a reason for the log), or None."""
    variants = {type(m).__name__ for m in model.modules() if isinstance(m, MultiHeadAttention) and type(m) is not FastMultiHeadAttention}  # fmt: skip
    if variants:
        return f"attention variants ({', '.join(sorted(variants))}) keep state of their own"
    if any(type(m) is not decoder_layer for m in model.decoder_layers):
        return "decoder layers of another class"
    return None


def traced_sources() -> list[Path]:
    """The files a program's code comes from: the model's package and the fast package (its
    caches, attention, layers and int8 calls, which the trace runs through), this file included."""
    here = Path(__file__).parent
    return sorted([*(here.parent / "model").glob("*.py"), *here.glob("*.py")])


@functools.cache
def code_digest() -> str:
    """A digest of the code a program is traced from (traced_sources), so a program kept by an
    earlier version of any of it is not used."""
    digest = hashlib.blake2b(digest_size=16)
    for path in traced_sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def weights_places(model: Transformer) -> tuple:
    """Where each weight a step reads lives and how often it was written in place: its name, the
    address of its data, its version counter and shape. Any change of the weights (an optimizer
    step, load_state_dict, a parameter replaced) changes it."""
    return tuple((k, place(t), t._version, tuple(t.shape)) for k, t in step_weights(model).items())


def place(t: Tensor) -> int:
    """The address of `t`'s data, or for a tensor without storage (a weight packed into an opaque
    tensor) the tensor object's identity."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return id(t)


def weights_digest(model: Transformer) -> str:
    """A digest of the model's configuration, of its decoder's int8 layers and their kernels (the
    program prepares their inputs), and of each weight a step reads: its name, shape, dtype and
    the CRC-32 of its bytes (read in place: 10 ms for 30 MB, a third of a hash's time)."""
    digest = hashlib.blake2b(repr(model.cfg).encode(), digest_size=16)
    for name, layer in int8_layers(model.decoder_layers, "decoder_layers").items():
        digest.update(f"int8 {name} {layer.kernel}".encode())
    for name, t in step_weights(model).items():
        try:
            crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        except (RuntimeError, TypeError):  # no storage to read: the tensor object stands for its data
            crc = f"object {id(t)}"
        digest.update(f"{name} {tuple(t.shape)} {t.dtype} {crc}".encode())
    return digest.hexdigest()


def program_path(weights: str, width: int, library: str) -> Path:
    """Where the program for these weights (weights_digest), width class and products is kept."""
    key = f"{code_digest()} | {weights} | {machine_key()} | threads {torch.get_num_threads()} | width {width} | products {library}"  # fmt: skip
    return cache_dir() / "compiled" / f"step-{hashlib.blake2b(key.encode(), digest_size=16).hexdigest()}.pt2"


class CompiledStep:
    """A model's compiled steps (`runtime.compiled_step`: None = kept ones only, True = compile a
    missing one, False = never): `take` says whether one runs a given step, `__call__` runs it.
    decoder_layer: the fast decoder-layer class the traced model's layers get (FastDecoderLayer).
    The programs found are those of the weights the model had when they were found (`places`);
    at each new decoding state `take` checks that the weights are still those (fresh)."""

    def __init__(self, setting: bool | None, decoder_layer: type):
        self.setting, self.decoder_layer = setting, decoder_layer
        self.programs: dict[int, object] = {}  # width class (1, or 2 for several rows per sentence) -> program
        self.digest: str | None = None  # of the weights the programs hold (weights_digest)
        self.places: tuple | None = None  # where those weights were, and their versions (weights_places)
        self.state = lambda: None  # the decoding state last checked (a weak reference)
        self.int8: dict = {}  # the model's int8 layers by name, which its programs call (int8_call.products_of)

    def __deepcopy__(self, memo) -> CompiledStep:
        """A copy of the model (to quantize it, say) finds programs of its own."""
        return CompiledStep(self.setting, self.decoder_layer)

    def fresh(self, model: Transformer, state) -> None:
        """Once per decoding state: where the model's step weights changed since its programs were
        found, forget the programs unless the weights' digest is the same (a version bumped
        without a change); the next step finds those of the new weights."""
        if self.state() is state:
            return
        try:
            self.state = weakref.ref(state)
        except TypeError:  # a state that takes no weak reference is checked at every step
            self.state = lambda: None
        places = weights_places(model)
        if places == self.places:
            return
        digest = weights_digest(model) if self.places is not None else None
        if digest != self.digest and self.programs:
            log.info("compiled decoding step: the model's weights changed since its programs were found; finding those of its new weights")  # fmt: skip
            self.programs.clear()
        self.places, self.digest = places, digest

    def take(self, model: Transformer, tgt: Tensor, state, need_weights: bool) -> bool:
        """Whether the step decoding `tgt` into `state` runs compiled: one new token per row, at
        most MAX_WIDTH per sentence, fp32 on a CPU, no gradients, autocast or weights asked, the fast
        runtime's caches past the first step, and a program for its width class kept or compiled."""
        if self.setting is False or need_weights or state is None or tgt.size(1) != 1 or not tgt.is_cpu:
            return False
        if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
            return False
        if type(state) is not DecoderState or not state.layers:
            return False
        first = state.layers[0]
        if not isinstance(first.self, FastKeyValueCache) or first.self.keys is None or first.cross.k is None:
            return False
        if first.self.k.dtype != torch.float32 or first.cross.k.dtype != torch.float32:
            return False
        sentences = first.cross.k.size(0)
        if tgt.size(0) % sentences or tgt.size(0) > MAX_WIDTH * sentences:
            return False
        self.fresh(model, state)
        return self.program(model, 1 if tgt.size(0) == sentences else 2) is not None

    def program(self, model: Transformer, width: int):
        if width not in self.programs:
            self.programs[width] = self.find(model, width)
            self.int8 = int8_layers(model.decoder_layers, "decoder_layers")
        return self.programs[width]

    def find(self, model: Transformer, width: int):
        """The program for `width`, loaded or compiled, or None; logs which and why once."""
        what = "one row per sentence" if width == 1 else "several rows per sentence"
        reason = unsupported(model, self.decoder_layer)
        if reason is not None:
            log_once(f"compiled decoding step: not used, {reason}")
            return None
        if self.setting is None and not any((cache_dir() / "compiled").glob("step-*.pt2")):
            log_once(f"compiled decoding step ({what}): none kept on this machine, eager steps (runtime.compiled_step=true compiles one)")  # fmt: skip
            return None
        self.digest = self.digest or weights_digest(model)
        library, why = products()
        path = program_path(self.digest, width, library)
        program = self.load(path, what) if path.exists() else None
        if program is None:
            if self.setting is None:
                log_once(f"compiled decoding step ({what}): none kept for this model and CPU, eager steps (runtime.compiled_step=true compiles one)")  # fmt: skip
                return None
            if compiler() is None:
                log_once(f"compiled decoding step ({what}): no C++ compiler ({os.environ.get('CXX') or 'g++'} not found), eager steps")  # fmt: skip
                return None
            with timings.locked(path):  # one process compiles it; another waits, then loads it
                program = self.load(path, what, quiet=True) if path.exists() else None
                if program is None and self.compile(model, width, path, what, library):
                    program = self.load(path, what)
            if program is None:
                return None
        log_once(f"compiled decoding step ({what}): steps after the first run {path}")
        where = "packed for oneDNN" if library == "onednn" else "on torch's BLAS"
        log_once(f"compiled decoding step: fp32 products {where} in the program ({why})")
        return program

    def compile(self, model: Transformer, width: int, path: Path, what: str, library: str) -> bool:
        """Compile the program for `width` into `path` (compile_step); False, logged, where it fails."""
        log_once(f"compiled decoding step ({what}): compiling it once for this model and CPU into {path}")
        start = time.perf_counter()
        try:
            compile_step(model, width, path, self.decoder_layer, library)
        except Exception as e:  # noqa: BLE001 - any failure of the compiler leaves the eager step
            log.warning("compiled decoding step (%s): compiling failed (%s: %s), eager steps", what, type(e).__name__, str(e).splitlines()[0] if str(e) else "")  # fmt: skip
            return False
        log_once(f"compiled decoding step ({what}): compiled in {time.perf_counter() - start:.1f} s")
        return True

    def load(self, path: Path, what: str, quiet: bool = False):
        """The program kept in `path`, or None with one warning line naming it where it cannot be
        loaded (broken, or another torch's): compiled again with runtime.compiled_step=true."""
        try:
            return load_program(path)
        except Exception as e:  # noqa: BLE001 - an unreadable package leaves the eager step or a new one
            if not quiet:
                then = "compiling it again" if self.setting and compiler() is not None else "eager steps"
                log.warning("compiled decoding step (%s): %s could not be loaded (%s: %s), %s", what, path, type(e).__name__, str(e).splitlines()[0] if str(e) else "", then)  # fmt: skip
            return None

    def __call__(self, model: Transformer, tgt: Tensor, src_mask: Tensor, state: DecoderState) -> Tensor:
        """Decode one token per row of `tgt` (rows, 1) into `state`: the decoder's normalized output (rows, 1, d_model)."""
        layers = state.layers
        sentences = layers[0].cross.k.size(0)
        width = tgt.size(0) // sentences
        caches = [cache for layer in layers for cache in (layer.self.keys, layer.self.values)]
        position = caches[0].length
        for cache in caches:  # room for this step's token
            if position == cache.buffer.size(2):
                cache.grow(2 * position, cache.value)
        buffers = [c.buffer.view(sentences, width, *c.buffer.shape[1:]) for c in caches]
        tokens = tgt.reshape(sentences, width).contiguous()  # the program reads its inputs as contiguous
        inputs = [tokens, torch.tensor([position]), src_mask.contiguous(), *buffers[0::2], *buffers[1::2]]
        inputs += [layer.cross.k for layer in layers] + [layer.cross.v for layer in layers]
        with products_of(self.int8):
            (hidden,) = self.program(model, 1 if width == 1 else 2)(inputs)
        for layer in layers:
            for cache in (layer.self.keys, layer.self.values):
                cache.length += 1
            layer.self.k, layer.self.v = layer.self.keys.value, layer.self.values.value
        state.advance(1)
        return hidden
