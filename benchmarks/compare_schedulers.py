"""serve.py under both schedulers, one after the other in one run: for each number of clients,
load_test.py's throughput and latency, the errors, and the server's peak resident memory.

    python benchmarks/compare_schedulers.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt \\
        input=data/multi30k/test_2016_flickr.de.gz clients=[1,8,32,64] seconds=30 output=schedulers.json

Arguments (key=value): checkpoint, input (sentences, one per line), clients, seconds,
schedulers=[batch,continuous], serve=['KEY=VALUE',...] (more serve.py arguments, each quoted),
output. Prints one table row per scheduler and client count, and the ratios continuous / batch.
A server that serves with another scheduler than it was asked for (continuous batching falls back
to batch for the models and settings it cannot run: /health says which and why) is one error
line and exit status 1, before anything is measured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import httpx

from common import hardware
from load_test import LoadTestConfig, load
from transformer.cli import parse_args, setup_logging
from transformer.data import read_lines
from transformer.errors import exit_on_user_error
from transformer.files import atomic_write_text, check_output

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class CompareSchedulersConfig:
    checkpoint: str = "???"
    input: str = "data/multi30k/test_2016_flickr.de.gz"
    clients: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    seconds: float = 30.0
    schedulers: list[str] = field(default_factory=lambda: ["batch", "continuous"])
    serve: list[str] = field(default_factory=list)
    output: Optional[str] = None


class ServeProcess:
    """serve.py on a free port; its log is read by a thread (a full pipe would stall it)."""

    def __init__(self, args: list[str]):
        command = [sys.executable, str(ROOT / "serve.py"), "port=0", *args]
        self.process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        self.url, self.ready = None, threading.Event()
        threading.Thread(target=self.read, daemon=True).start()

    def read(self) -> None:
        for line in self.process.stderr:
            found = re.search(r"serving .* on (http://\S+?)/? ", line)
            if found:
                self.url = found.group(1)
            if "ready" in line:
                self.ready.set()

    def peak_rss_mib(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def main(argv: list[str]) -> None:
    setup_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request costs the server CPU time
    with exit_on_user_error():
        cfg = parse_args(argv, CompareSchedulersConfig, __doc__)
        output = None if cfg.output is None else check_output(cfg.output, [cfg.input])
        sentences = [line for line in read_lines(Path(cfg.input)) if line]
    rows = []
    for scheduler in cfg.schedulers:
        server = ServeProcess([f"checkpoint={cfg.checkpoint}", f"scheduler={scheduler}", *cfg.serve])
        if not server.ready.wait(300) or server.url is None:
            server.stop()
            sys.exit(f"error: serve.py scheduler={scheduler} did not start")
        problem = scheduler_problem(server.url, scheduler)
        if problem:
            server.stop()
            sys.exit(f"error: {problem}")
        try:
            for clients in cfg.clients:
                load_cfg = LoadTestConfig(input=cfg.input, url=server.url, clients=clients, seconds=cfg.seconds)
                result = asyncio.run(load(load_cfg, sentences))
                row = {"scheduler": scheduler, "clients": clients, **{k: result[k] for k in ("throughput_sentences_per_s", "latency_ms", "errors")}}  # fmt: skip
                row["peak_rss_mib"] = round(server.peak_rss_mib(), 1)
                rows.append(row)
                print_row(row)
        finally:
            server.stop()
    ratios = compare(rows)
    for line in ratios:
        print(line)
    if output is not None:
        atomic_write_text(
            output, json.dumps({"hardware": hardware(), "config": asdict(cfg), "rows": rows}, indent=2) + "\n"
        )


def scheduler_problem(url: str, asked: str) -> str | None:
    """None when the server at `url` serves with the scheduler asked for; otherwise which one it
    serves with and why (its /health), since its numbers would be the other scheduler's."""
    health = httpx.get(url + "/health", timeout=60).json()
    if health["scheduler"] == asked:
        return None
    why = health.get("scheduler_fallback", "/health gives no reason")
    return f"serve.py was asked for scheduler={asked} but serves with scheduler={health['scheduler']} ({why}); no numbers measured"  # fmt: skip


def print_row(row: dict) -> None:
    lat = row["latency_ms"]
    print(f"{row['scheduler']:<11} {row['clients']:>3} clients: {row['throughput_sentences_per_s']:7.1f} sent/s  "
          f"p50 {lat['p50']:7.1f} ms  p99 {lat['p99']:7.1f} ms  errors {row['errors']}  peak RSS {row['peak_rss_mib']:.0f} MiB", flush=True)  # fmt: skip


def compare(rows: list[dict]) -> list[str]:
    """continuous / batch at each client count: throughput, p50 and p99 latency."""
    by = {(r["scheduler"], r["clients"]): r for r in rows}
    lines = []
    for (scheduler, clients), row in sorted(by.items()):
        base = by.get(("batch", clients))
        if scheduler != "continuous" or base is None:
            continue
        t = row["throughput_sentences_per_s"] / base["throughput_sentences_per_s"]
        p50 = row["latency_ms"]["p50"] / base["latency_ms"]["p50"]
        p99 = row["latency_ms"]["p99"] / base["latency_ms"]["p99"]
        lines.append(f"continuous / batch at {clients} clients: throughput {t:.2f}x, p50 {p50:.2f}x, p99 {p99:.2f}x")
    return lines


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
