import gzip
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "multi30k"


def usable_cpus() -> int:
    """The CPUs this process may run on (a container or taskset may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (the default, see pyproject.toml): one test worker per usable CPU."""
    return usable_cpus()


# Under pytest-xdist the workers share the CPUs: each gets its share of torch threads, and so do
# the train.py and translate.py commands the tests start (their torch reads OMP_NUM_THREADS), so
# that two workers on two cores do not run four busy threads.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, usable_cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


def write_corpus(directory: Path, split: str, pairs: dict[str, list[str]], gz: bool = True) -> None:
    """Write one split as {split}.{lang}[.gz] files, one sentence per line."""
    directory.mkdir(parents=True, exist_ok=True)
    for lang, lines in pairs.items():
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        if gz:
            (directory / f"{split}.{lang}.gz").write_bytes(gzip.compress(data))
        else:
            (directory / f"{split}.{lang}").write_bytes(data)


def make_tiny_corpus(out: Path) -> Path:
    for split, n in (("train", 400), ("val", 40), ("test_2016_flickr", 40)):
        pairs = {}
        for lang in ("de", "en"):
            with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                pairs[lang] = [next(f).strip() for _ in range(n)]
        write_corpus(out, split, pairs)
    return out


@pytest.fixture
def tiny_corpus(tmp_path) -> Path:
    """A small real slice of Multi30k (de, en) in the shipped layout; tests may change it."""
    return make_tiny_corpus(tmp_path / "corpus")


@pytest.fixture(scope="session")
def shared_corpus(tmp_path_factory) -> Path:
    """The same slice, shared by the tests that only read it."""
    return make_tiny_corpus(tmp_path_factory.mktemp("shared") / "corpus")


def pytest_terminal_summary(terminalreporter) -> None:
    """The oneDNN kernels the CPU-dependent fast paths ran (tests/test_kernels.py), and the CPU."""
    lines = [value for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("skipped", [])
             for name, value in getattr(report, "user_properties", []) if name == "kernels"]  # fmt: skip
    if lines:
        from transformer.devices import describe_cpu

        terminalreporter.write_sep("-", f"kernels ({describe_cpu()})")
        for line in sorted(lines):
            terminalreporter.write_line(line)
