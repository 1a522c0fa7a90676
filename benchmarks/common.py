"""What the benchmarks of this folder share (they import it as `common`: `python benchmarks/NAME.py`
puts the folder on sys.path): what hardware we ran on, its matmul peak, timing (in this process, or
CTranslate2's in a child process), the models compared (ours, Hugging Face's MarianMT,
torch.nn.Transformer completed into a translation model) and other processes that keep cores busy."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from transformer.devices import CPU_FEATURES, cpu_flags, isa_limit
from transformer.fast import accelerate
from transformer.model import ModelConfig, Transformer
from transformer.model.blocks import SinusoidalPositions


def hardware() -> dict:
    """The device and CPU features, so figures from different machines are never compared blindly."""
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    info["isa_limit"] = isa_limit()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        fields = {}  # of the first processor listed
        for key, _, value in (line.partition(":") for line in cpuinfo.splitlines()):
            fields.setdefault(key.strip(), value.strip())
        flags = cpu_flags(cpuinfo)
        info["cpu"] = fields.get("model name", "")
        # A virtual machine may name only the brand ("AMD EPYC"); family and model tell generations apart.
        info["cpu_family_model"] = f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}"
        info["cpu_features"] = [f for f in CPU_FEATURES if f in flags]
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


def padded(sources: list[list[int]], eos_id: int) -> torch.Tensor:
    """Token-id sentences, each with EOS appended, as one right-padded (pad 0) batch."""
    return torch.nn.utils.rnn.pad_sequence([torch.tensor(s + [eos_id]) for s in sources], batch_first=True)


# Run by CTranslate2InChild in a process of its own: load the model, translate once untimed (allocations,
# packing, kernel setup), then once timed; prints the seconds and the best hypothesis of each sentence.
CT2_TIMER = """
import json, sys, time, ctranslate2
directory, compute_type, threads, pieces, options = json.load(sys.stdin)
translator = ctranslate2.Translator(directory, device="cpu", compute_type=compute_type, intra_threads=threads)
translator.translate_batch(pieces, **options)
start = time.perf_counter()
results = translator.translate_batch(pieces, **options)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "hypotheses": [r.hypotheses[0] for r in results]}))
"""


@dataclass
class CTranslate2InChild:
    """A CTranslate2 decoding timed in a child process, each time: once CTranslate2 has run in a
    process, its thread pool stays there beside torch's and slows the torch decoders timed after it,
    ours and HF alike (docs/PERFORMANCE.md, "int8 decoding and CTranslate2"). Calling it returns
    (seconds, the best hypothesis of each sentence as target pieces)."""

    directory: str
    compute_type: str
    threads: int
    pieces: list
    options: dict

    def __call__(self) -> tuple[float, list[list[str]]]:
        payload = json.dumps([self.directory, self.compute_type, self.threads, self.pieces, self.options])
        done = subprocess.run([sys.executable, "-c", CT2_TIMER], input=payload, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"CTranslate2 ({self.compute_type}) failed: {done.stderr.strip()[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        return result["seconds"], result["hypotheses"]


def matmul_peak(dtype: torch.dtype, device: torch.device, repeats: int = 10) -> float:
    """Dense matmul GFLOP/s of this device at this dtype, on random data. On CPU (n = 2048): the
    faster of torch's `a @ b` (BLAS for fp32, oneDNN for bf16) and oneDNN's product, which
    transformer/linear.py uses for fp32. On a GPU (n = 8192): cuBLAS, fp32 without TF32 (torch's
    default, and what fp32 training here uses)."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    products = [lambda: a @ b]
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
    best = 0.0
    for product in products:
        for _ in range(3 if device.type == "cuda" else 1):  # warm-up: library load, clocks ramping up
            product()
        seconds, _ = timed(partial(repeat, product, repeats), device)
        best = max(best, 2 * n**3 * repeats / seconds / 1e9)
    return best


def repeat(fn, times: int) -> None:
    for _ in range(times):
        fn()


def our_model(vocab: int, layers: int, d_model: int, heads: int, d_ff: int, dropout: float, runtime=None, **block):
    """This package's Transformer with the same dimensions as `marian_model` takes, with the speed
    paths `runtime` (a RuntimeConfig; default: all) asks for; `block`: more ModelConfig fields
    (e.g. those of model/small_modern), else the paper's block."""
    cfg = ModelConfig(vocab, n_encoder_layers=layers, n_decoder_layers=layers, d_model=d_model, n_heads=heads, d_ff=d_ff, dropout=dropout, **block)  # fmt: skip
    return accelerate(Transformer(cfg), runtime)


def marian_model(vocab: int, layers: int, d_model: int, heads: int, d_ff: int, dropout: float):
    """Hugging Face's MarianMTModel with our dimensions: the peer the benchmarks compare against
    (shared embeddings, scaled by sqrt(d_model), ReLU, PAD 0, BOS 2 as decoder start, EOS 3)."""
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=d_ff, decoder_ffn_dim=d_ff,
        max_position_embeddings=1024, pad_token_id=0, eos_token_id=3, decoder_start_token_id=2,
        activation_function="relu", dropout=dropout, scale_embedding=True, share_encoder_decoder_embeddings=True,
    )  # fmt: skip
    return MarianMTModel(config)


class TorchTransformer(torch.nn.Module):
    """torch.nn.Transformer completed into a translation model the way its users do it: shared
    embeddings scaled by sqrt(d_model), sinusoidal positions, the output layer tied to them."""

    def __init__(self, vocab: int, layers: int, d_model: int, heads: int, d_ff: int, dropout: float):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model, padding_idx=0)
        self.positions = SinusoidalPositions(d_model, 1024)
        self.core = torch.nn.Transformer(d_model, heads, layers, layers, d_ff, dropout, batch_first=True)
        self.scale = d_model**0.5

    def forward(self, src, tgt):
        src_pad, tgt_pad = src == 0, tgt == 0
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device, dtype=torch.bool)
        x = self.core(
            self.positions(self.embed(src) * self.scale),
            self.positions(self.embed(tgt) * self.scale),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
        )
        return F.linear(x, self.embed.weight)


@contextmanager
def busy_cores(n: int):
    """n other processes, each keeping one core busy, for as long as the block runs (a machine
    that is doing other work)."""
    others = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for process in others:
            process.kill()
            process.wait()
