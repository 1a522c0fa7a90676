"""Load a running serve.py: N concurrent clients each send one sentence at a time, for T seconds,
sentences taken in turn from a file. Prints throughput, latency percentiles, errors and the
server's mean batch size over the run (from its /metrics); writes them as JSON. With expected=,
every answer is compared with its line of that file (translate.py's output for the same input and
settings): answers that differ are counted and the first ones shown.

    python serve.py checkpoint=PATH &
    python benchmarks/load_test.py input=data/multi30k/val.de.gz clients=16 seconds=20 output=load.json

Arguments (key=value, as for train.py):
    url=http://127.0.0.1:8000   the server
    input=PATH                  sentences, one per line (plain or .gz); empty lines are skipped
    clients=16  seconds=20      concurrent clients and how long they send
    beam_size=0                 0: the server's setting; else sent with each request
    expected=PATH               the translation each input line must get (one per input line)
    output=PATH                 the JSON of the results (default: only printed)
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import httpx
import numpy as np

from transformer.cli import parse_args, setup_logging
from transformer.data import read_lines
from transformer.errors import ConfigError, DataError, exit_on_user_error
from transformer.files import atomic_write_text, check_output


@dataclass
class LoadTestConfig:
    input: str = "???"
    url: str = "http://127.0.0.1:8000"
    clients: int = 16
    seconds: float = 20.0
    beam_size: int = 0
    expected: Optional[str] = None
    output: Optional[str] = None

    def __post_init__(self) -> None:
        if self.clients < 1 or not self.seconds > 0 or self.beam_size < 0:
            raise ValueError(f"clients={self.clients} must be >= 1, seconds={self.seconds} > 0, beam_size={self.beam_size} >= 0")  # fmt: skip


@dataclass
class Tally:
    latencies: list[float]
    errors: list[str]
    differ: list[str]  # answers that are not the expected translation


async def client(http: httpx.AsyncClient, sentences: list[str], start: int, step: int, until: float, body: dict, tally: Tally, expected: list[str] | None):  # fmt: skip
    """One client: a request, wait for its answer, the next, until `until`; sentence start, start + step, ..."""
    i = start
    while time.perf_counter() < until:
        sent = time.perf_counter()
        try:
            response = await http.post("/v1/translate", json={"text": sentences[i % len(sentences)], **body})
            if response.status_code == 200:
                tally.latencies.append(time.perf_counter() - sent)
                got, want = response.json()["translations"], expected and [expected[i % len(sentences)]]
                if expected is not None and got != want:
                    tally.differ.append(f"{sentences[i % len(sentences)]!r}: {got!r}, expected {want!r}")
            else:
                tally.errors.append(f"{response.status_code}: {response.text[:200]}")
        except httpx.HTTPError as e:
            tally.errors.append(f"{type(e).__name__}: {e}")
        i += step


def batch_totals(metrics_text: str) -> tuple[float, float]:
    """(sentences decoded, batches decoded) so far, from the server's Prometheus text."""

    def value(name: str) -> float:
        found = re.search(rf"^{name} (\S+)$", metrics_text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    return value("serve_batch_sentences_sum"), value("serve_batch_sentences_count")


async def load(cfg: LoadTestConfig, sentences: list[str], expected: list[str] | None = None) -> dict:
    body = {"beam_size": cfg.beam_size} if cfg.beam_size else {}
    tally = Tally([], [], [])
    limits = httpx.Limits(max_connections=cfg.clients)
    async with httpx.AsyncClient(base_url=cfg.url, timeout=60, limits=limits) as http:
        try:
            before = batch_totals((await http.get("/metrics")).text)
        except httpx.HTTPError as e:
            raise ConfigError(f"cannot reach the server at url={cfg.url}: {e}") from None
        started = time.perf_counter()
        until = started + cfg.seconds
        await asyncio.gather(
            *(client(http, sentences, k, cfg.clients, until, body, tally, expected) for k in range(cfg.clients))
        )
        elapsed = time.perf_counter() - started
        after = batch_totals((await http.get("/metrics")).text)
    return summary(cfg, tally, elapsed, after[0] - before[0], after[1] - before[1])


def summary(cfg: LoadTestConfig, tally: Tally, elapsed: float, sentences: float, batches: float) -> dict:
    ms = np.array(tally.latencies) * 1000
    percentile = lambda q: round(float(np.percentile(ms, q)), 1) if len(ms) else None  # noqa: E731
    return {
        "config": asdict(cfg),
        "seconds": round(elapsed, 2),
        "sentences": len(ms),
        "throughput_sentences_per_s": round(len(ms) / elapsed, 2),
        "latency_ms": {
            "p50": percentile(50),
            "p95": percentile(95),
            "p99": percentile(99),
            "mean": round(float(ms.mean()), 1) if len(ms) else None,
        },  # fmt: skip
        "errors": len(tally.errors),
        "first_errors": tally.errors[:5],
        **({"not_expected": len(tally.differ), "first_not_expected": tally.differ[:5]} if cfg.expected else {}),
        "mean_batch_sentences": round(sentences / batches, 2) if batches else None,
    }


def main(argv: list[str]) -> None:
    setup_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request costs the server CPU time
    with exit_on_user_error():
        cfg = parse_args(argv, LoadTestConfig, __doc__)
        output = None if cfg.output is None else check_output(cfg.output, [cfg.input])
        lines = read_lines(Path(cfg.input))
        expected = None if cfg.expected is None else read_lines(Path(cfg.expected))
        if expected is not None and len(expected) != len(lines):
            raise DataError(f"expected={cfg.expected} has {len(expected)} lines, input={cfg.input} {len(lines)}")
        kept = [i for i, line in enumerate(lines) if line]
        sentences = [lines[i] for i in kept]
        if not sentences:
            raise DataError(f"input={cfg.input} has no sentences")
        results = asyncio.run(load(cfg, sentences, None if expected is None else [expected[i] for i in kept]))
        latency = results["latency_ms"]
        print(f"{cfg.clients} clients, {results['seconds']} s: {results['throughput_sentences_per_s']} sentences/s, "
              f"latency p50 {latency['p50']} ms, p95 {latency['p95']} ms, p99 {latency['p99']} ms, "
              f"{results['errors']} errors, mean batch {results['mean_batch_sentences']} sentences")  # fmt: skip
        if expected is not None:
            print(f"{results['not_expected']} answers differ from expected={cfg.expected}", *results["first_not_expected"], sep="\n")  # fmt: skip
        if output is not None:
            atomic_write_text(output, json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
