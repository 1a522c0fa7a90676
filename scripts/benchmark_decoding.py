"""Decoding speed with and without the key/value cache, measured side by side in one run.

    python scripts/benchmark_decoding.py                      # base model, random weights, 100 sentences
    python scripts/benchmark_decoding.py checkpoint=PATH sentences=300 output=bench.json

For each strategy (greedy, beam 5) it decodes the same Multi30k test_2016_flickr sources with the
cached decoder and with full recomputation of the prefix at every step (`Uncached`), checks that
both produce the same tokens, and prints sentences/s, generated tokens/s and the speed-up.
With random weights no sentence ends early, so every hypothesis runs to the maximum length
(a * source + b tokens): both decoders do exactly the same work.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from transformer.benchmarking import hardware, timed
from transformer.cli import parse_args
from transformer.config import exit_on_user_error
from transformer.data import DataConfig, load_split
from transformer.decoder_models import Uncached
from transformer.decoding import DecodeConfig, translate_ids
from transformer.model import ModelConfig, Transformer, count_parameters
from transformer.tokenizer import Tokenizer


@dataclass
class BenchConfig:
    checkpoint: Optional[str] = None  # default: the paper's base model with random weights
    sentences: int = 100
    beam_size: int = 5
    vocab_size: int = 8000  # for the tokenizer trained when no checkpoint is given
    data_dir: str = "data/multi30k"
    device: str = "cpu"
    threads: int = 0
    output: Optional[str] = None  # JSON file for the results


def model_and_tokenizer(cfg: BenchConfig, device):
    if cfg.checkpoint:
        from transformer.checkpoint import load_model

        model, tokenizer, _ = load_model(Path(cfg.checkpoint), device)
        return model, tokenizer, cfg.checkpoint
    train = load_split(DataConfig(dir=cfg.data_dir), "train")
    tokenizer = Tokenizer.train(list(train["src"]) + list(train["tgt"]), cfg.vocab_size, "unigram")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=len(tokenizer), dropout=0.0)).to(device).eval()
    return model, tokenizer, "base (6+6 layers, d_model 512, 8 heads, d_ff 2048), random weights"


def run_one(model, sources, tokenizer, decode_cfg, device) -> tuple[float, list]:
    seconds, n_best = timed(lambda: translate_ids(model, sources, tokenizer, decode_cfg, device), device)
    return seconds, [hyps[0].tokens for hyps in n_best]


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, BenchConfig, __doc__)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    model, tokenizer, model_name = model_and_tokenizer(cfg, device)
    test = load_split(DataConfig(dir=cfg.data_dir), "test_2016_flickr")
    sources = tokenizer.encode(list(test["src"])[: cfg.sentences])
    results = {
        "hardware": hardware(),
        "model": model_name,
        "parameters": count_parameters(model),
        "sentences": len(sources),
        "rows": [],
    }
    print(json.dumps(results["hardware"]))
    print(f"model: {model_name}, {results['parameters']:,} parameters; {len(sources)} test_2016_flickr sentences")
    print(f"{'strategy':<10}{'decoder':<10}{'sent/s':>10}{'tok/s':>10}{'seconds':>10}{'speed-up':>10}")
    for strategy in ("greedy", "beam"):
        decode_cfg = dataclasses.replace(DecodeConfig(), strategy=strategy, beam_size=cfg.beam_size)
        label = f"beam{cfg.beam_size}" if strategy == "beam" else strategy
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
    if cfg.output:
        Path(cfg.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
