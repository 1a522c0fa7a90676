"""Timings a speed path takes once per machine and keeps on disk, so that its choice is the same in
every run on that machine and a busy moment cannot change it: int8's check of each layer shape
(int8.py) and the choice between a packed oneDNN product and torch's BLAS, by rows (linear.py).

A timing is kept under a key naming what it depends on: the CPU and its features, the
instruction-set limits in the environment, the libraries (machine_key), the thread count, the
shape and the kernel (int8.py, linear.py). The files live in $TRANSFORMER_CACHE_DIR, else
$XDG_CACHE_HOME/transformer, else ~/.cache/transformer, shared by every run on the machine; deleting
one times again. So each is changed only under a lock (`locked`, which other caches of that
directory hold too): read, merged with the new entry and replaced whole through a temporary file,
so two processes timing at once keep both their entries and a reader never sees half a file.
A file that is broken or not a file of timings is named in one warning and rebuilt; one that cannot
be written is logged.
"""

from __future__ import annotations

import datetime
import fcntl
import functools
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for `path` during the block, so that one process at a time reads,
    changes and replaces it. The lock is on a file beside it (`path`.lock), never removed: `path`
    itself is replaced by each write, and a lock on the file replaced would lock nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def cpu_name() -> str:
    return cpu_info("model name", "unknown CPU")


@functools.cache
def libraries() -> str:
    """The libraries the products run on: torch and its build (which fixes the FBGEMM compiled
    into it, which names no version of its own), oneDNN and MKL, as torch was built with them."""
    config = torch.__config__.show()
    onednn = re.search(r"(?:MKL-DNN|oneDNN) v([\d.]+)", config)
    mkl = re.search(r"Math Kernel Library Version ([\d.]+)", config)
    build = (torch.version.git_version or "unknown")[:12]
    onednn, mkl = (found[1] if found else "none" for found in (onednn, mkl))
    return f"torch {torch.__version__} ({build}), oneDNN {onednn}, MKL {mkl}"


def machine_key() -> str:
    """What every timing depends on: the CPU, its features, the instruction-set limits, the libraries."""
    features = ",".join(f for f in CPU_FEATURES if f in cpu_flags())
    limits = ",".join(f"{v}={os.environ[v]}" for v in ISA_VARIABLES if os.environ.get(v))
    return f"{cpu_name()} | {features} | {limits or 'no limits'} | {libraries()}"


def threads_key() -> str:
    """The threads a product runs on: a timing on one thread says little of one on eight."""
    return f"threads {torch.get_num_threads()}"


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


def entries(path: Path) -> dict[str, dict]:
    """The timings kept in `path` ({key: {"ratio": float, "date": ...}}): none when it is missing or
    cannot be read (keep says so if it cannot be written either), and none, after one warning
    naming it, when it is broken or holds something else, so that keep writes it anew."""
    try:
        found = json.loads(path.read_text())
    except OSError:
        return {}
    except ValueError as e:  # UnicodeDecodeError too
        return broken(path, f"is not JSON ({e})")
    if not isinstance(found, dict):
        return broken(path, f"holds a JSON {type(found).__name__}, not timings by key")
    odd = next((key for key, value in found.items() if not is_timing(value)), None)
    if odd is not None:
        return broken(path, f'holds {json.dumps(found[odd])[:60]} where a timing ({{"ratio": float, ...}}) belongs')
    return found


def is_timing(value) -> bool:
    return isinstance(value, dict) and isinstance(value.get("ratio"), float)


def broken(path: Path, problem: str) -> dict:
    """No timings, said once for this version of the file (each read of it would say it again)."""
    try:
        stat = path.stat()
        version = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        version = None
    warn_once(str(path), problem, version)
    return {}


@functools.cache
def warn_once(path: str, problem: str, version: tuple[int, int] | None) -> None:
    log.warning("Timings file %s %s: it is timed again and written anew", path, problem)


def entry(what: str, key: str) -> dict | None:
    """The entry kept under `key` in timings_path(what) ({"ratio": float, "date": ...}), or None."""
    return entries(timings_path(what)).get(key)


def read(what: str, key: str) -> float | None:
    """The value kept under `key` in timings_path(what), or None."""
    found = entry(what, key)
    return None if found is None else found["ratio"]


def keep(what: str, key: str, value: float) -> None:
    """Keep `value` under `key` in timings_path(what), beside what the file holds when the lock is
    taken (what other processes kept meanwhile included); a file that cannot be written is logged
    (the next run times again)."""
    path = timings_path(what)
    try:
        with locked(path):
            kept = entries(path)
            kept[key] = {"ratio": float(value), "date": datetime.date.today().isoformat()}
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
