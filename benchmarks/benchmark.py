"""Training throughput against peer implementations, measured side by side in one run.

    python benchmarks/benchmark.py                                  # small and base, fp32 (+ bf16 where the CPU has bf16 matrix instructions)
    python benchmarks/benchmark.py presets=[small] steps=5 output=bench.json
    python benchmarks/benchmark.py presets=[small] threads=1 max_tokens=2048   # as one of two trainer.members
    python benchmarks/benchmark.py device=cuda precisions=[bf16] max_tokens=32768   # on a GPU
    python benchmarks/benchmark.py presets=[small_modern] implementations=[ours,ours-blas,ours-onednn] isa=avx2
    python benchmarks/benchmark.py presets=[small_modern] implementations=[ours,ours-spin-default] busy=1 rounds=3

The implementations and presets are built in training_peers.py. Presets: small (3+3 layers,
d_model 256), base (6+6, 512), and small_modern, the default recipe's model (small with
model/small_modern's block: measured for ours only, the peers lack that block), and tiny (1+1,
d_model 64: quick, for the tests).
At equal model size (vocabulary 8000, shared embeddings) and on the same real Multi30k batches
(grouped by token count), each implementation runs forward + backward + Adam step:
  ours          transformer.model.Transformer
  torch         torch.nn.Transformer with embeddings, sinusoidal positions and a tied output layer
  hf-marian     transformers' MarianMTModel (only if `transformers` is installed: pip install -e ".[bench]")
  ours-compile, ours-recompute   ours with trainer.compile / trainer.recompute (on request, e.g.
                implementations=[ours,ours-compile,ours-recompute])
  ours-blas     ours with runtime.onednn_linear=false: fp32 products on torch's BLAS, as in torch
                and hf-marian (on request); ours-onednn: with runtime.onednn_linear=true, oneDNN's
                products on any CPU (by default they are used where AVX-512 runs)
  ours-logits   ours with runtime.chunked_loss=false: full (tokens, vocab) logits and torch's
                cross-entropy, as in torch and hf-marian, not the chunked loss (on request)
  ours-reference  the reference model without any speed path (runtime=reference; on request)
  ours-spin-default  ours with GNU OpenMP's own spin before idle threads sleep, not the shorter
                one the package sets (transformer/openmp.py); the peers run with OpenMP's default
                too. Compare them with busy=1 (on request)
  ours-foreach  ours with torch's default (foreach) Adam instead of the fused one that the trainer
                and every other implementation here use (on request)
Each (implementation, preset, precision) runs in its own process, so its peak memory (max RSS
on CPU; on a GPU, the most device memory torch allocated) is its own. The batches are built once
(the tokenizer is trained once) and handed to every process in a file. With rounds=R every
measurement is repeated R times, the implementations taking turns in alternating order, and the
median is reported with the spread: a machine whose speed drifts during the run (shared or
throttled CPUs) then biases no implementation. Reported: non-padding source+target tokens/s, the
ratio to each peer, estimated model FLOP/s as a fraction of the dense matmul peak measured in the
same run, peak memory, and on CPU the milliseconds per step of the Adam update (part of the step).
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from common import busy_cores, hardware, matmul_peak
from training_peers import BLOCKS, BUILDERS, PRESETS, VOCAB
from transformer import openmp
from transformer.cli import parse_args
from transformer.devices import ISA_LIMITS, cpu_has_bf16_matmul, limit_isa, pick_device, require_cpp_compiler
from transformer.errors import ConfigError, exit_on_user_error
from transformer.files import atomic_write_text, check_output
from transformer.training.optimizer import adam

IMPLEMENTATIONS = ("ours", "torch", "hf-marian")  # also: ours-compile, -recompute, -blas, -logits, -foreach, -reference


@dataclass
class BenchConfig:
    presets: list[str] = field(default_factory=lambda: ["small", "base"])
    implementations: list[str] = field(default_factory=lambda: list(IMPLEMENTATIONS))
    precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16"])  # bf16 only with bf16 matrix instructions
    steps: int = 8  # timed steps, after 2 warm-up steps
    rounds: int = 1  # repetitions of every measurement, interleaved; the median is reported (odd: the middle one)
    max_tokens: int = 4096  # per batch; on a GPU larger batches (e.g. 32768) are needed to keep it busy
    data_dir: str = "data/multi30k"
    device: str = "auto"  # cuda when present, else cpu
    threads: int = 0  # CPU threads per measurement; 0 = torch's default; 1 = as each of trainer.members
    output: Optional[str] = None
    isa: Optional[str] = (
        None  # avx2: measure with oneDNN, ATen and MKL kept to AVX2, as on a CPU without AVX-512 (no bf16)
    )
    busy: int = 0  # other processes that keep a core busy during every measurement, as on a loaded machine
    peak_repeats: int = 10  # products timed for the dense matmul peak, each round; fewer: a quicker, noisier peak
    one: Optional[str] = None  # internal: "impl,preset,precision" runs one measurement in this process
    batches: Optional[str] = None  # internal: the file of batches the measurement processes share

    def __post_init__(self) -> None:
        if self.isa is not None and self.isa not in ISA_LIMITS:
            raise ValueError(f"isa={self.isa!r} is not one of {tuple(ISA_LIMITS)} (or null)")
        lows = {"steps": 1, "rounds": 1, "max_tokens": 1, "threads": 0, "busy": 0, "peak_repeats": 1}
        for key, low in lows.items():
            if getattr(self, key) < low:
                raise ValueError(f"{key}={getattr(self, key)} must be >= {low}")


# --- The same batches for everyone --------------------------------------------------------------


def real_batches(cfg: BenchConfig, n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """(src, tgt_in, tgt_out, non-padding tokens) of the first n shuffled Multi30k training batches."""
    import numpy as np

    from transformer.data import DataConfig, load_split
    from transformer.data.batching import collate, token_batches, tokenize
    from transformer.data.tokenizer import Tokenizer

    ds = load_split(DataConfig(dir=cfg.data_dir), "train")
    tokenizer = Tokenizer.train(ds["src"][:] + ds["tgt"][:], VOCAB, "unigram")  # whole columns: not row by row
    corpus = tokenize(ds, tokenizer)
    order = token_batches(corpus.lengths(), cfg.max_tokens, np.random.default_rng(0))[:n]
    if len(order) < n:
        raise ConfigError(f"max_tokens={cfg.max_tokens} gives {len(order)} batches, fewer than steps + 2 = {n}")
    out = []
    for indices in order:
        b = collate(corpus, indices, tokenizer)
        out.append((b.src, b.tgt_in, b.tgt_out, b.n_src_tokens + b.n_tgt_tokens))
    return out


# --- Measuring ----------------------------------------------------------------------------------


def step_flops(batch, layers: int, d_model: int, d_ff: int) -> float:
    """Matmul FLOPs of one training step on the padded batch (backward = 2x forward), counting
    projections, feed-forward, attention scores and mixing, and the output layer."""
    src, tgt = batch[0], batch[1]
    s_tok, t_tok, s_len, t_len, d = src.numel(), tgt.numel(), src.size(1), tgt.size(1), d_model
    ffn = 2 * 2 * d * d_ff
    encoder = s_tok * layers * (2 * 4 * d * d + ffn + 4 * s_len * d)
    cross_kv = s_tok * layers * 2 * 2 * d * d  # cross-attention keys and values, once per source token
    decoder = t_tok * (layers * (2 * 6 * d * d + ffn + 4 * (t_len + s_len) * d) + 2 * d * VOCAB)
    return 3 * (encoder + cross_kv + decoder)


def measure_one(cfg: BenchConfig, impl: str, preset: str, precision: str) -> dict:
    layers, d_model, heads, d_ff = PRESETS[preset]
    device = pick_device(cfg.device)
    torch.manual_seed(0)
    batches = torch.load(cfg.batches) if cfg.batches else real_batches(cfg, cfg.steps + 2)
    block = {"block": BLOCKS[preset]} if preset in BLOCKS else {}
    model, loss_fn = BUILDERS[impl](layers, d_model, heads, d_ff, **block)
    model.to(device).train()
    fused = impl != "ours-foreach"  # the trainer's Adam (transformer/training/optimizer.py), for every implementation
    optimizer = adam(model.parameters(), 1e-4, (0.9, 0.98), 1e-9, 0.0, device, fused=fused)
    dtype = torch.bfloat16 if precision == "bf16" else None
    tokens, flops, elapsed, warm_tokens, warm_elapsed, update_elapsed, timed_steps = 0, 0.0, 0.0, 0, 0.0, 0.0, 0
    # On a GPU the first step of each batch shape loads and selects kernels, which here took longer
    # than the step itself: all batches are run once untimed, then again timed. On CPU the first
    # two steps warm up (allocators, oneDNN primitives); the rest are timed.
    warmup = len(batches) if device.type == "cuda" else 2
    for i, batch in enumerate(batches * 2 if device.type == "cuda" else batches):
        src, tgt_in, tgt_out = (t.to(device, non_blocking=True) for t in batch[:3])
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(src, tgt_in, tgt_out)
        (loss / batch[3]).backward()
        update_start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_seconds = time.perf_counter() - update_start  # on a GPU only the kernel launches
        loss.item()  # the host sync a real training loop has once per step; the step's GPU work is done
        if i >= warmup:
            elapsed += time.perf_counter() - start
            update_elapsed += update_seconds
            timed_steps += 1
            tokens += batch[3]
            flops += step_flops(batch, layers, d_model, d_ff)
        elif i >= 2:  # the warm-up after its first two steps, for comparison
            warm_elapsed += time.perf_counter() - start
            warm_tokens += batch[3]
    row = {
        "implementation": impl, "preset": preset, "precision": precision, "device": device.type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens_per_s": tokens / elapsed, "model_gflops": flops / elapsed / 1e9,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "adam_ms": 1e3 * update_elapsed / timed_steps if device.type == "cpu" else None,
    }  # fmt: skip
    if device.type == "cuda":
        row["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
        row["warmup_tokens_per_s"] = warm_tokens / max(warm_elapsed, 1e-9)
    return row


def child_environment(impl: str) -> dict:
    """The environment of a measurement's process: this one's. Ours bounds oneDNN's primitive
    caches where its speed paths are installed (transformer/fast/linear.py) and shortens OpenMP's
    spin (transformer/openmp.py); the peers and ours-spin-default run with OpenMP's and oneDNN's
    defaults, as their users have them."""
    if impl.startswith("ours") and impl != "ours-spin-default":
        return dict(os.environ)
    return openmp.without_default(os.environ)


def run_isolated(impl: str, preset: str, precision: str, cfg: BenchConfig) -> dict | None:
    args = [
        sys.executable,
        __file__,
        f"one='{impl},{preset},{precision}'",
        f"steps={cfg.steps}",
        f"max_tokens={cfg.max_tokens}",
        f"data_dir={cfg.data_dir}",
        f"device={cfg.device}",
        f"threads={cfg.threads}",
        f"batches={cfg.batches}",
    ]
    result = subprocess.run(args, capture_output=True, text=True, env=child_environment(impl))
    if result.returncode != 0:
        print(f"{impl} {preset} {precision}: failed: {result.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def median_row(runs: list[dict]) -> dict:
    """The run with the median tokens/s, carrying every run's tokens/s and the largest peak memory."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["tokens_per_s_runs"] = [round(r["tokens_per_s"]) for r in runs]
    for key in ("peak_rss_mb", "peak_gpu_mb"):
        if key in row:
            row[key] = max(r[key] for r in runs)
    return row


def available(impl: str) -> bool:
    if impl != "hf-marian":
        return True
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("hf-marian skipped: transformers is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return False
    return True


def print_table(rows: list[dict], peaks: dict) -> None:
    print(
        f"{'preset':<13}{'precision':<10}{'implementation':<18}{'params':>11}{'tok/s':>9}{'vs torch':>9}{'vs hf fp32':>11}{'of peak':>9}{'peak MB':>9}{'Adam ms':>9}"
    )
    for row in rows:
        same = {
            r["implementation"]: r for r in rows if r["preset"] == row["preset"] and r["precision"] == row["precision"]
        }
        hf_fp32 = next(
            (
                r
                for r in rows
                if r["preset"] == row["preset"] and r["precision"] == "fp32" and r["implementation"] == "hf-marian"
            ),
            None,
        )
        vs_torch = row["tokens_per_s"] / same["torch"]["tokens_per_s"] if "torch" in same else None
        vs_hf = row["tokens_per_s"] / hf_fp32["tokens_per_s"] if hf_fp32 else None
        row.update(vs_torch=vs_torch, vs_hf_fp32=vs_hf, fraction_of_peak=row["model_gflops"] / peaks[row["precision"]])
        memory = row.get("peak_gpu_mb", row["peak_rss_mb"])  # a GPU's memory where there is one
        adam = "-" if row.get("adam_ms") is None else f"{row['adam_ms']:.1f}"
        print(f"{row['preset']:<13}{row['precision']:<10}{row['implementation']:<18}{row['parameters']:>11,}{row['tokens_per_s']:>9.0f}"
              f"{ratio(vs_torch):>9}{ratio(vs_hf):>11}{row['fraction_of_peak']:>8.0%}{memory:>9.0f}{adam:>9}")  # fmt: skip


def print_against_ours(rows: list[dict]) -> None:
    """Each variant of ours (ours-*) against ours, at the same preset and precision: ours' tokens/s
    over the variant's (above 1: ours is faster)."""
    ours = {(r["preset"], r["precision"]): r for r in rows if r["implementation"] == "ours"}
    for row in rows:
        base = ours.get((row["preset"], row["precision"]))
        if base and row["implementation"].startswith("ours-"):
            speedup = base["tokens_per_s"] / row["tokens_per_s"]
            print(f"{row['preset']} {row['precision']}: ours over {row['implementation']} {speedup:.2f}x")


def ratio(value: float | None) -> str:
    """A speed ratio for the table; '-' where the peer was not measured (JSON holds null)."""
    return "-" if value is None else f"{value:.2f}x"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure_rounds(cfg: BenchConfig, impls: list[str], precisions: list[str], peaks: dict, device) -> dict:
    """Every implementation's runs, one per round, each in a process of its own: {(preset,
    precision, implementation): [row, ...]}. Who goes first alternates between rounds, and each
    round after the first measures the matmul peak again, keeping the highest in `peaks`."""
    runs: dict[tuple, list[dict]] = {}
    for round_ in range(cfg.rounds):
        if round_:
            peaks.update({p: max(peaks[p], matmul_peak(DTYPES[p], device, cfg.peak_repeats)) for p in precisions})
        order = impls if round_ % 2 == 0 else impls[::-1]
        for preset, precision, impl in itertools.product(cfg.presets, precisions, order):
            if preset in BLOCKS and not impl.startswith("ours"):
                continue
            row = run_isolated(impl, preset, precision, cfg)
            if row:
                runs.setdefault((preset, precision, impl), []).append(row)
                print(f"  {preset} {precision} {impl}: {row['tokens_per_s']:.0f} tok/s", flush=True)
    return runs


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, BenchConfig, __doc__)
        if cfg.output:  # checked now, not after the measurements
            check_output(cfg.output, [cfg.batches])
        limit_isa(cfg.isa, __file__, argv)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    if cfg.one:
        print(json.dumps(measure_one(cfg, *cfg.one.split(","))))
        return
    device = pick_device(cfg.device)
    impls = [i for i in cfg.implementations if available(i)]
    if any("compile" in i for i in impls):
        with exit_on_user_error():  # the trainer's check, before any measurement
            require_cpp_compiler(device, "ours-compile", "leave it out of implementations")
    info = hardware()
    has_bf16 = device.type == "cuda" or (cpu_has_bf16_matmul() and cfg.isa is None)
    precisions = [p for p in cfg.precisions if p == "fp32" or has_bf16]
    peaks = {p: matmul_peak(DTYPES[p], device, cfg.peak_repeats) for p in precisions}
    info["busy_processes"] = cfg.busy
    print(json.dumps(info))
    peak_text = ", ".join(f"{p} {peaks[p]:.0f} GFLOP/s" for p in precisions)
    print(f"device {device.type}; dense matmul peak: {peak_text}; bf16 autocast measured: {has_bf16}")
    if cfg.busy:
        print(f"{cfg.busy} other process(es) keep a core busy during every measurement (not the peak's)")
    with tempfile.TemporaryDirectory() as tmp:
        if not cfg.batches:  # built once, read by every measurement
            cfg.batches = str(Path(tmp) / "batches.pt")
            with exit_on_user_error():
                torch.save(real_batches(cfg, cfg.steps + 2), cfg.batches)
        with busy_cores(cfg.busy):  # after the batches are built
            runs = measure_rounds(cfg, impls, precisions, peaks, device)
    rows = [median_row(r) for r in runs.values()]
    print_table(rows, peaks)
    print_against_ours(rows)
    if cfg.rounds > 1:
        for row in rows:
            spread = row["tokens_per_s_runs"]
            print(
                f"{row['preset']} {row['precision']} {row['implementation']}: tok/s of the {len(spread)} rounds {spread}"
            )
    if cfg.output:
        with exit_on_user_error():
            atomic_write_text(cfg.output, json.dumps({"hardware": info, "matmul_peak_gflops": peaks, "rows": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
