"""Timings a speed path takes once per machine and keeps on disk, so that its choice is the same in
every run on that machine and a busy moment cannot change it: int8's check of each layer shape
(int8.py) and the choice between a packed oneDNN product and torch's BLAS, by rows (linear.py).

A timing is kept under a key naming what it depends on: the CPU and its features, the
instruction-set limits in the environment, torch, and the product it times (linear.py adds the
thread count). The files live in $TRANSFORMER_CACHE_DIR, else $XDG_CACHE_HOME/transformer, else
~/.cache/transformer; deleting one times again. A file that cannot be read is timed again; one
that cannot be written is logged.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..devices import CPU_FEATURES, ISA_VARIABLES, cpu_flags, cpu_info
from ..files import atomic_write_text

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    root = os.environ.get("TRANSFORMER_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "transformer"


def timings_path(what: str) -> Path:
    return cache_dir() / f"{what}_timings.json"


def cpu_name() -> str:
    return cpu_info("model name", "unknown CPU")


def machine_key() -> str:
    """What every timing depends on: the CPU, its features, the instruction-set limits, torch."""
    features = ",".join(f for f in CPU_FEATURES if f in cpu_flags())
    limits = ",".join(f"{v}={os.environ[v]}" for v in ISA_VARIABLES if os.environ.get(v))
    return f"{cpu_name()} | {features} | {limits or 'no limits'} | torch {torch.__version__}"


def seconds(fn: Callable, x, repeats: int = 5) -> float:
    """The fastest of `repeats` calls of fn(x), after one to warm up."""
    fn(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best


def time_ratio(fn: Callable, baseline: Callable, x, rounds: int = 4, repeats: int = 5) -> float:
    """The fastest call of fn(x) over the fastest of baseline(x), taken in alternating rounds of
    `repeats` calls each, so a slow moment (a frequency change, another process) falls on both.
    Each round warms up with one call (seconds)."""
    best_fn = best_baseline = float("inf")
    for _ in range(rounds):
        best_fn = min(best_fn, seconds(fn, x, repeats))
        best_baseline = min(best_baseline, seconds(baseline, x, repeats))
    return best_fn / best_baseline


def entries(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def entry(what: str, key: str) -> dict | None:
    """The entry kept under `key` in timings_path(what) ({"ratio": float, "date": ...}), or None."""
    found = entries(timings_path(what)).get(key)
    return found if isinstance(found, dict) and isinstance(found.get("ratio"), float) else None


def read(what: str, key: str) -> float | None:
    """The value kept under `key` in timings_path(what), or None."""
    found = entry(what, key)
    return None if found is None else found["ratio"]


def keep(what: str, key: str, value: float) -> None:
    """Keep `value` under `key` in timings_path(what), beside what the file holds; a file that
    cannot be written is logged (the next run times again)."""
    path = timings_path(what)
    kept = entries(path)
    kept[key] = {"ratio": value, "date": datetime.date.today().isoformat()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(kept, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        log.warning("%s timings not kept (%s): the next run times them again", what, e)


def kept(what: str, key: str, measure: Callable[[], float]) -> tuple[float, str]:
    """The value kept under `key` in timings_path(what), or measure() now, kept there; and where it
    came from ("timed on DATE" or "timed now")."""
    found = entry(what, key)
    if found is not None:
        return found["ratio"], f"timed on {found.get('date', '?')}"
    value = measure()
    keep(what, key, value)
    return value, "timed now"
