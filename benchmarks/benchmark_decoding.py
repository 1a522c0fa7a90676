"""Decoding speed, measured side by side in one run: with and without the key/value cache, and
against Hugging Face transformers' `generate` at the same model size.

    python benchmarks/benchmark_decoding.py                      # both parts, random weights
    python benchmarks/benchmark_decoding.py checkpoint=PATH sentences=300 peers=false output=bench.json
    python benchmarks/benchmark_decoding.py device=cuda                 # on a GPU (device=auto picks it)

1. Cache: for each strategy (greedy, beam 5) it decodes the same Multi30k test_2016_flickr sources
   with the cached decoder and with full recomputation of the prefix at every step (`Uncached`),
   checks that both produce the same tokens, and prints sentences/s, tokens/s and the speed-up.
   With random weights no sentence ends early, so both decoders do exactly the same work.
2. Peers (if transformers is installed): for each preset (small, base) ours and MarianMTModel, both
   with random weights of the same dimensions, decode the same `peer_sentences` sources in one
   batch, greedy and beam 5, each forced to generate exactly `new_tokens` tokens (our
   decode.min_len / max_len; HF's min_new_tokens / max_new_tokens), so both do the same work.
   On a GPU, and where the CPU has bf16 matrix instructions (AMX or AVX512-BF16), both also run
   under bf16 autocast (our runtime.precision=bf16). On a GPU each is run once untimed first.
   In fp32 `ours-blas` is ours with runtime.onednn_linear=false (torch's BLAS, as HF uses) and
   `ours-onednn` with runtime.onednn_linear=true (by default, oneDNN is used where AVX-512 runs);
   `ours-reference` is the reference model without any speed path (runtime=reference).
   Each pair is timed `rounds` times, taking turns in alternating order; the medians are
   compared, so a machine whose speed drifts biases neither side.
3. CTranslate2 (if ctranslate2 is installed; ctranslate2=false skips it): for each preset, our
   random-weight model is exported (transformer/interop/export.py) and the same weights decode the same
   `peer_sentences` sources in one batch, forced to `new_tokens` steps, greedy and beam 5: ours in
   fp32, bf16 (where the CPU has bf16 matrix instructions) and int8 (runtime.precision=int8), and
   CTranslate2 with compute_type float32, int8 and bfloat16 (where its CPU build offers it), all with the same
   threads; timed in turns as in part 2 and compared with CTranslate2 float32 (`vs ct2 fp32`)
   and, with peers and transformers, with HF generate in fp32 in the same turns (`vs hf fp32`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from common import CTranslate2InChild, hardware, marian_model, our_model, padded, timed
from transformer.cli import parse_args
from transformer.data import DataConfig, load_split
from transformer.data.tokenizer import Tokenizer
from transformer.decoding import DecodeConfig, Uncached, translate_ids
from transformer.devices import ISA_LIMITS, cpu_has_bf16_matmul, limit_isa, pick_device
from transformer.errors import exit_on_user_error
from transformer.fast import accelerate
from transformer.fast.int8 import quantize_int8
from transformer.fast.linear import AVAILABLE as ONEDNN_AVAILABLE
from transformer.files import atomic_write_text, check_output
from transformer.interop.export import export
from transformer.model import ModelConfig, Transformer, count_parameters
from transformer.runtime import RuntimeConfig


@dataclass
class BenchConfig:
    checkpoint: Optional[str] = None  # default: the paper's base model with random weights
    sentences: int = 100
    beam_size: int = 5
    vocab_size: int = 8000  # for the tokenizer trained when no checkpoint is given
    data_dir: str = "data/multi30k"
    device: str = "auto"  # cuda when present, else cpu
    threads: int = 0
    peers: bool = True  # part 2: against HF generate (needs transformers)
    ctranslate2: bool = True  # part 3: against CTranslate2 on the same weights (needs ctranslate2)
    presets: list[str] = field(default_factory=lambda: ["small", "base"])
    peer_sentences: int = 64
    new_tokens: int = 30
    precisions: list[str] = field(
        default_factory=lambda: ["fp32", "bf16"]
    )  # part 2: fp32 and/or bf16 (on CPUs with bf16 matrix instructions)
    rounds: int = 3  # part 2: timings of each pair, alternating who goes first; medians are compared
    output: Optional[str] = None  # JSON file for the results
    isa: Optional[str] = (
        None  # avx2: measure with oneDNN, ATen and MKL kept to AVX2, as on a CPU without AVX-512 (no bf16)
    )

    def __post_init__(self) -> None:
        if self.isa is not None and self.isa not in ISA_LIMITS:
            raise ValueError(f"isa={self.isa!r} is not one of {tuple(ISA_LIMITS)} (or null)")
        # new_tokens: forced decoding of that many tokens, EOS included; vocab_size: more than the 4 special pieces
        lows = {"sentences": 1, "beam_size": 1, "vocab_size": 5, "threads": 0, "peer_sentences": 1, "new_tokens": 2, "rounds": 1}  # fmt: skip
        for key, low in lows.items():
            if getattr(self, key) < low:
                raise ValueError(f"{key}={getattr(self, key)} must be >= {low}")


def model_and_tokenizer(cfg: BenchConfig, device):
    if cfg.checkpoint:
        from transformer.translator import Translator

        translator = Translator.load(cfg.checkpoint, [], str(device))
        return translator.model, translator.tokenizer, cfg.checkpoint
    train = load_split(DataConfig(dir=cfg.data_dir), "train")
    tokenizer = Tokenizer.train(list(train["src"]) + list(train["tgt"]), cfg.vocab_size, "unigram")
    torch.manual_seed(0)
    model = accelerate(Transformer(ModelConfig(vocab_size=len(tokenizer), dropout=0.0))).to(device).eval()
    return model, tokenizer, "base (6+6 layers, d_model 512, 8 heads, d_ff 2048), random weights"


def run_one(model, sources, tokenizer, decode_cfg, device) -> tuple[float, list]:
    seconds, n_best = timed(lambda: translate_ids(model, sources, tokenizer, decode_cfg, device), device)
    return seconds, [hyps[0].tokens for hyps in n_best]


PRESETS = {"small": (3, 256, 4, 1024), "base": (6, 512, 8, 2048)}  # layers per side, d_model, heads, d_ff


@torch.no_grad()
def hf_generate(model, src: torch.Tensor, beams: int, new_tokens: int) -> torch.Tensor:
    return model.generate(
        input_ids=src, attention_mask=src != 0, num_beams=beams, do_sample=False,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
    )  # fmt: skip


def race(runs: dict, rounds: int, device: torch.device) -> dict[str, tuple[list[float], object]]:
    """Time each callable `rounds` times, taking turns in alternating order: name -> (seconds, last result).
    On a GPU each runs once untimed first (library handles, kernel selection, clocks ramping up)."""
    out = {name: ([], None) for name in runs}
    names = list(runs)
    if device.type == "cuda":
        for name in names:
            runs[name]()
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            seconds, result = runs[name]() if isinstance(runs[name], CTranslate2InChild) else timed(runs[name], device)
            out[name] = (out[name][0] + [seconds], result)
    return out


def hf_generate_in(precision: str, model, src, beams: int, new_tokens: int) -> torch.Tensor:
    with torch.autocast(src.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        return hf_generate(model, src, beams, new_tokens)


def peer_rows(cfg: BenchConfig, tokenizer, sources: list[list[int]], device: torch.device) -> list[dict]:
    """Ours against HF generate, same sizes and forced lengths; one batch of peer_sentences.
    At bf16 (GPUs, CPUs with bf16 matrix instructions) both run under the same autocast; `vs hf` compares with HF at
    the same precision, `vs hf fp32` with HF in fp32."""
    import transformers

    sources = sources[: cfg.peer_sentences]
    src = padded(sources, tokenizer.eos_id).to(device)
    has_bf16 = device.type == "cuda" or (cpu_has_bf16_matmul() and cfg.isa is None)
    precisions = [p for p in ("fp32", "bf16") if p in cfg.precisions and (p == "fp32" or has_bf16)]
    hf_name, rows = f"hf-marian {transformers.__version__}", []
    for preset in cfg.presets:
        layers, d_model, heads, d_ff = PRESETS[preset]
        ours = {}  # the same weights under each runtime: all speed paths, fp32 on torch's BLAS, the reference
        for name, runtime in (("ours", RuntimeConfig()), ("ours-blas", RuntimeConfig(onednn_linear=False)), ("ours-onednn", RuntimeConfig(onednn_linear=True)), ("ours-reference", RuntimeConfig(fast=False))):  # fmt: skip
            torch.manual_seed(0)
            ours[name] = our_model(len(tokenizer), layers, d_model, heads, d_ff, dropout=0.0, runtime=runtime).to(device).eval()  # fmt: skip
        torch.manual_seed(0)
        theirs = marian_model(len(tokenizer), layers, d_model, heads, d_ff, dropout=0.0).to(device).eval()
        for strategy, beams in (("greedy", 1), ("beam", 5)):
            label, hf_fp32 = "greedy" if beams == 1 else f"beam{beams}", None
            for precision in precisions:
                forced = DecodeConfig(strategy=strategy, beam_size=max(beams, 1), max_len_a=0.0, max_len_b=cfg.new_tokens, min_len=cfg.new_tokens - 1, max_tokens=10**9)  # fmt: skip
                ours_in = partial(translate_ids, precision=precision)  # our decoders in this precision
                runs = {
                    "ours": partial(ours_in, ours["ours"], sources, tokenizer, forced, device),
                    hf_name: partial(hf_generate_in, precision, theirs, src, beams, cfg.new_tokens),
                    "ours-reference": partial(ours_in, ours["ours-reference"], sources, tokenizer, forced, device),
                }
                # the effect of transformer/fast/linear.py's oneDNN path (CPU fp32 only)
                if precision == "fp32" and device.type == "cpu" and ONEDNN_AVAILABLE:
                    for name in ("ours-blas", "ours-onednn"):  # off and on; `ours` has the default's choice
                        runs[name] = partial(ours_in, ours[name], sources, tokenizer, forced, device)
                timings = race(runs, cfg.rounds, device)
                seconds = {name: statistics.median(times) for name, (times, _) in timings.items()}
                if precision == "fp32":
                    hf_fp32 = seconds[hf_name]
                for name, (times, result) in timings.items():
                    lengths = (
                        [result.size(1) - 1] if name == hf_name else sorted({len(h[0].tokens) + 1 for h in result})
                    )  # without HF's decoder start token
                    rows.append({
                        "preset": preset, "strategy": label, "precision": precision, "decoder": name,
                        "seconds": seconds[name], "seconds_of_rounds": [round(t, 3) for t in times],
                        "sentences_per_s": len(sources) / seconds[name],
                        "tokens_per_s": len(sources) * cfg.new_tokens / seconds[name],
                        "generated_lengths": lengths,
                    })  # fmt: skip
                    if name != hf_name:
                        rows[-1]["vs_hf"] = seconds[hf_name] / seconds[name]
                        if hf_fp32 is not None:
                            rows[-1]["vs_hf_fp32"] = hf_fp32 / seconds[name]
    return rows


def print_peer_rows(rows: list[dict]) -> None:
    print(f"{'preset':<7}{'strategy':<9}{'precision':<10}{'decoder':<24}{'sent/s':>9}{'tok/s':>9}{'vs hf':>8}{'vs hf fp32':>11}  lengths")  # fmt: skip
    for r in rows:
        ratio = f"{r['vs_hf']:.2f}x" if "vs_hf" in r else ""
        ratio32 = f"{r['vs_hf_fp32']:.2f}x" if "vs_hf_fp32" in r else ""
        print(f"{r['preset']:<7}{r['strategy']:<9}{r['precision']:<10}{r['decoder']:<24}{r['sentences_per_s']:>9.1f}{r['tokens_per_s']:>9.0f}{ratio:>8}{ratio32:>11}  {r['generated_lengths']}")  # fmt: skip


def measure_cache(cfg: BenchConfig, model, sources, tokenizer, device, results: dict) -> None:
    """Greedy and beam search with the incremental cache and without it (every step re-runs the
    decoder over the whole prefix): a row per strategy and decoder in results["rows"], and per
    strategy whether both gave the same tokens and the cache's speed-up."""
    print(f"{'strategy':<10}{'decoder':<10}{'sent/s':>10}{'tok/s':>10}{'seconds':>10}{'speed-up':>10}")
    for strategy in ("greedy", "beam"):
        decode_cfg = dataclasses.replace(DecodeConfig(), strategy=strategy, beam_size=cfg.beam_size)
        label = f"beam{cfg.beam_size}" if strategy == "beam" else strategy
        for decoder in (model, Uncached(model)):  # untimed: one-time costs (allocations, kernel setup)
            run_one(decoder, sources[:2], tokenizer, decode_cfg, device)
        cached_s, cached = run_one(model, sources, tokenizer, decode_cfg, device)
        uncached_s, uncached = run_one(Uncached(model), sources, tokenizer, decode_cfg, device)
        n_tokens = sum(len(t) + 1 for t in cached)
        for name, seconds in (("cached", cached_s), ("uncached", uncached_s)):
            row = {
                "strategy": label,
                "decoder": name,
                "seconds": seconds,
                "sentences_per_s": len(sources) / seconds,
                "tokens_per_s": n_tokens / seconds,
            }
            results["rows"].append(row)
            speedup = f"{uncached_s / cached_s:.2f}x" if name == "cached" else "1.00x"
            print(
                f"{label:<10}{name:<10}{row['sentences_per_s']:>10.1f}{row['tokens_per_s']:>10.0f}{seconds:>10.1f}{speedup:>10}"
            )
        results[f"{label}_same_tokens"] = cached == uncached
        results[f"{label}_speedup"] = uncached_s / cached_s
        print(f"{label}: cached and uncached give the same tokens: {cached == uncached}")


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, BenchConfig, __doc__)
        if cfg.output:  # checked now, not after the measurements
            check_output(cfg.output, [cfg.checkpoint])
        limit_isa(cfg.isa, __file__, argv)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = pick_device(cfg.device)
        model, tokenizer, model_name = model_and_tokenizer(cfg, device)
    test = load_split(DataConfig(dir=cfg.data_dir), "test_2016_flickr")
    sources = tokenizer.source.encode(list(test["src"])[: cfg.sentences])
    results = {
        "hardware": hardware(),
        "model": model_name,
        "parameters": count_parameters(model),
        "sentences": len(sources),
        "rows": [],
    }
    print(json.dumps(results["hardware"]))
    print(f"model: {model_name}, {results['parameters']:,} parameters; {len(sources)} test_2016_flickr sentences")
    measure_cache(cfg, model, sources, tokenizer, device, results)
    if cfg.peers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("peers skipped: transformers is not installed (pip install -e '.[bench]')", file=sys.stderr)
        else:
            print(f"against HF generate: {cfg.peer_sentences} sentences in one batch, {cfg.new_tokens} tokens each")
            results["peers"] = peer_rows(cfg, tokenizer, sources_for_peers(cfg, tokenizer, test), device)
            print_peer_rows(results["peers"])
    if cfg.ctranslate2:
        try:
            import ctranslate2
        except ImportError:
            print("ctranslate2 skipped: it is not installed (pip install -e '.[export]')", file=sys.stderr)
        else:
            supported = sorted(ctranslate2.get_supported_compute_types("cpu"))
            print(f"CTranslate2 compute types on this CPU: {supported}")
            print(f"against CTranslate2 {ctranslate2.__version__}: the same weights, {cfg.peer_sentences} sentences in one batch, {cfg.new_tokens} steps each")  # fmt: skip
            results["ctranslate2"] = ctranslate2_rows(cfg, tokenizer, sources_for_peers(cfg, tokenizer, test), device)
            print_ctranslate2_rows(results["ctranslate2"])
    if cfg.output:
        with exit_on_user_error():
            atomic_write_text(cfg.output, json.dumps(results, indent=2))


def ctranslate2_decoders(cfg: BenchConfig, model, tokenizer, sources, directory: Path, beams: int) -> dict:
    """name -> callable decoding `sources` forced to cfg.new_tokens steps: ours and CTranslate2's."""
    import ctranslate2

    has_bf16 = cpu_has_bf16_matmul() and cfg.isa is None
    threads = torch.get_num_threads()
    strategy = "greedy" if beams == 1 else "beam"
    forced = DecodeConfig(strategy=strategy, beam_size=beams, max_len_a=0.0, max_len_b=cfg.new_tokens, min_len=cfg.new_tokens - 1, max_tokens=10**9)  # fmt: skip
    int8 = quantize_int8(copy.deepcopy(model))
    runs = {"ours fp32": partial(translate_ids, model, sources, tokenizer, forced, "cpu")}
    if has_bf16:
        runs["ours bf16"] = partial(translate_ids, model, sources, tokenizer, forced, "cpu", precision="bf16")  # fmt: skip
    runs["ours int8"] = partial(translate_ids, int8, sources, tokenizer, forced, "cpu", precision="int8")  # fmt: skip
    pieces = [[tokenizer.source.id_to_piece(t) for t in s] for s in sources]
    options = dict(beam_size=beams, max_decoding_length=cfg.new_tokens, min_decoding_length=cfg.new_tokens, length_penalty=0.0, max_batch_size=0)  # fmt: skip
    supported = ctranslate2.get_supported_compute_types("cpu")  # its CPU bfloat16 depends on the build and CPU
    for compute_type in [t for t in ("float32", "int8_float32", "bfloat16") if t in supported]:
        runs[f"ct2 {compute_type}"] = CTranslate2InChild(str(directory), compute_type, threads, pieces, options)
    return runs


def ctranslate2_rows(cfg: BenchConfig, tokenizer, sources: list[list[int]], device: torch.device) -> list[dict]:
    """Ours against CTranslate2 on the same (exported) random weights and forced lengths, on the CPU."""
    if device.type != "cpu":
        print("ctranslate2 skipped: measured on the CPU only", file=sys.stderr)
        return []
    rows = []
    src = padded(sources, tokenizer.eos_id)
    for preset in cfg.presets:
        layers, d_model, heads, d_ff = PRESETS[preset]
        torch.manual_seed(0)
        model = our_model(len(tokenizer), layers, d_model, heads, d_ff, dropout=0.0, runtime=RuntimeConfig()).eval()
        theirs = hf_baseline(cfg, len(tokenizer), layers, d_model, heads, d_ff)
        with tempfile.TemporaryDirectory() as tmp:
            export(model, tokenizer, Path(tmp) / "ct2", "float32")
            for beams in (1, cfg.beam_size):
                runs = ctranslate2_decoders(cfg, model, tokenizer, sources, Path(tmp) / "ct2", beams)
                if theirs is not None:
                    runs["hf-marian"] = partial(hf_generate, theirs, src, beams, cfg.new_tokens)
                for run in runs.values():  # untimed: one-time costs (allocations, packing, kernel setup)
                    if not isinstance(run, CTranslate2InChild):  # which times after its own untimed run
                        run()
                timings = race(runs, cfg.rounds, device)
                seconds = {name: statistics.median(times) for name, (times, _) in timings.items()}
                for name in runs:
                    rows.append({
                        "preset": preset, "strategy": "greedy" if beams == 1 else f"beam{beams}", "decoder": name,
                        "seconds": seconds[name], "seconds_of_rounds": [round(t, 3) for t in timings[name][0]],
                        "tokens_per_s": len(sources) * cfg.new_tokens / seconds[name],
                        "vs_ct2_fp32": seconds["ct2 float32"] / seconds[name],
                    })  # fmt: skip
                    if theirs is not None:
                        rows[-1]["vs_hf_fp32"] = seconds["hf-marian"] / seconds[name]
    return rows


def hf_baseline(cfg: BenchConfig, vocab: int, layers: int, d_model: int, heads: int, d_ff: int):
    """Part 3's baseline: MarianMTModel of the preset's size in fp32 (random weights; forced lengths
    make the work equal), or None with peers=false or without transformers."""
    if not cfg.peers:
        return None
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    torch.manual_seed(0)
    return marian_model(vocab, layers, d_model, heads, d_ff, dropout=0.0).eval()


def print_ctranslate2_rows(rows: list[dict]) -> None:
    print(f"{'preset':<7}{'strategy':<9}{'decoder':<18}{'tok/s':>9}{'seconds':>9}{'vs ct2 fp32':>12}{'vs hf fp32':>11}")
    for r in rows:
        vs_hf = f"{r['vs_hf_fp32']:.2f}x" if "vs_hf_fp32" in r else ""
        print(f"{r['preset']:<7}{r['strategy']:<9}{r['decoder']:<18}{r['tokens_per_s']:>9.0f}{r['seconds']:>9.2f}{r['vs_ct2_fp32']:>11.2f}x{vs_hf:>11}")  # fmt: skip


def sources_for_peers(cfg: BenchConfig, tokenizer, test) -> list[list[int]]:
    return tokenizer.source.encode(list(test["src"])[: cfg.peer_sentences])


if __name__ == "__main__":
    main(sys.argv[1:])
