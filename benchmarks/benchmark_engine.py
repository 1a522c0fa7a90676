"""The step-level engine (decoding/engine.py, on the paged cache) against the corpus decoder, on
one checkpoint and one file, in the same run.

    python benchmarks/benchmark_engine.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt
    python benchmarks/benchmark_engine.py checkpoint=PATH lines=1000 rounds=3 strategies=[greedy,beam] pool_mib=64

For each strategy (beam uses beam_size), the whole file is decoded `rounds` times by each decoder
in turns (decoding alone: the model is loaded once); the table gives the median sentences/s of
each, their ratio (engine / corpus), whether the translations are identical, and for the engine:
the most sentences that ran at once, preemptions, and the bytes its steps copied out of the pool
(per step, against the mean history length of the rows). Then the pool's capacity: with a pool
of `capacity_mib` MiB, the most beam sentences that ran at once, against the number that
worst-case reservation (every sentence's longest translation reserved at admission) would have
let in with the same pool. Prints the CPU's features first.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common import hardware
from transformer.cli import parse_args, setup_logging
from transformer.data import read_lines
from transformer.decoding import DecodeConfig
from transformer.decoding.engine import Engine, Sentence
from transformer.errors import exit_on_user_error
from transformer.translator import Translator


@dataclass
class EngineBenchConfig:
    checkpoint: str = "???"
    input: str = "data/multi30k/test_2016_flickr.de.gz"
    lines: int = 1000
    strategies: list[str] = field(default_factory=lambda: ["greedy", "beam"])
    beam_size: int = 5
    rounds: int = 3
    pool_mib: float = 256.0
    capacity_mib: float = 4.0
    join_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.lines < 1:
            raise ValueError(f"rounds={self.rounds} and lines={self.lines} must be >= 1")
        unknown = set(self.strategies) - {"greedy", "beam"}
        if unknown:
            raise ValueError(f"strategies: {sorted(unknown)} unknown; the engine runs greedy and beam")


def run_engine(engine: Engine, sources: list[list[int]], settings: DecodeConfig, eos_id: int, join_tokens: int):
    """Every source added at once, decoded to the end: (n-best lists in input order, steps, row-tokens attended)."""
    out = [None] * len(sources)
    for i, ids in enumerate(sources):
        engine.add(Sentence(ids + [eos_id], settings, lambda n_best, i=i: out.__setitem__(i, n_best)))
    steps = history = 0
    while engine.busy:
        history += sum(len(row.tokens) + 1 for s in engine.running for row in s.rows)
        if engine.step(join_tokens):
            steps += 1
    return out, steps, history


def reserved_at_once(engine: Engine, sources: list[list[int]], settings: DecodeConfig, eos_id: int) -> int:
    """The most sentences worst-case reservation would run at once with this engine's pool: taken
    in input order, each reserving its longest translation, until the pool is promised out."""
    most = 0
    for start in range(len(sources)):
        promised, count = 0, 0
        for ids in sources[start:]:
            sentence = Sentence(ids + [eos_id], settings, lambda n_best: None)
            sentence.max_len = engine.length_limit(len(sentence.ids), settings)
            need = engine.need(sentence)
            if promised + need > engine.pool.n_blocks:
                break
            promised, count = promised + need, count + 1
        most = max(most, count)
    return most


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, EngineBenchConfig, __doc__)
        translator = Translator.load(cfg.checkpoint, device="cpu")
        sources = translator.encode(read_lines(Path(cfg.input))[: cfg.lines])
    print(hardware())
    torch.set_grad_enabled(False)
    eos = translator.tokenizer.eos_id
    print(f"{len(sources)} lines of {cfg.input}, {cfg.rounds} rounds in turns, pool {cfg.pool_mib:g} MiB")
    print("| search | corpus sent/s | engine sent/s | engine / corpus | identical | most at once | preemptions | copied per step | mean history |")  # fmt: skip
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for strategy in cfg.strategies:
        settings = DecodeConfig(strategy=strategy, beam_size=cfg.beam_size)
        corpus_times, engine_times = [], []
        for _ in range(cfg.rounds):
            start = time.perf_counter()
            expected = translator.translate_ids(sources, settings)
            corpus_times.append(time.perf_counter() - start)
            engine = Engine(translator.model, translator.tokenizer, settings, "cpu", int(cfg.pool_mib * 2**20))
            start = time.perf_counter()
            got, steps, history = run_engine(engine, sources, settings, eos, cfg.join_tokens)
            engine_times.append(time.perf_counter() - start)
        same = [[h.tokens for h in n] for n in got] == [[h.tokens for h in n] for n in expected]
        corpus, ours = len(sources) / statistics.median(corpus_times), len(sources) / statistics.median(engine_times)
        per_step = engine.pool.gathered_bytes / steps / 2**20
        print(f"| {settings.label} | {corpus:.1f} | {ours:.1f} | {ours / corpus:.2f}x | {'yes' if same else 'NO'} | {engine.most_running} | {engine.preemptions} | {per_step:.2f} MiB | {history / steps:.0f} row-tokens |")  # fmt: skip
    settings = DecodeConfig(strategy="beam", beam_size=cfg.beam_size)
    engine = Engine(translator.model, translator.tokenizer, settings, "cpu", int(cfg.capacity_mib * 2**20))
    got, _, _ = run_engine(engine, sources, settings, eos, cfg.join_tokens)
    expected = translator.translate_ids(sources, settings)
    same = [[h.tokens for h in n] for n in got] == [[h.tokens for h in n] for n in expected]
    reserved = reserved_at_once(engine, sources, settings, eos)
    print(f"\nPool capacity at {cfg.capacity_mib:g} MiB ({engine.pool.n_blocks} blocks of {engine.pool.block_size}), {settings.label}:")  # fmt: skip
    print(f"most sentences at once: {engine.most_running} taking blocks as they grow, {reserved} reserving their longest: {engine.most_running / max(reserved, 1):.1f}x; preemptions {engine.preemptions}; translations identical to the corpus decoder's: {'yes' if same else 'NO'}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
