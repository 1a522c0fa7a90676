"""The shared timing caches (transformer/fast/timings.py): processes keeping timings at once all
keep theirs, a broken or foreign file is named once and rebuilt, and the keys name what a timing
depends on."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os

import pytest
import torch

from transformer.fast import int8, linear, timings
from transformer.files import atomic_open

WRITERS = 4
KEYS_EACH = 50


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path))
    return tmp_path


def keep_many(start, writer: int) -> None:
    start.wait()  # all writers at once, so their read-merge-writes overlap
    for i in range(KEYS_EACH):
        timings.keep("shared", f"writer {writer} key {i}", float(i))


def test_processes_keeping_at_once_keep_every_entry(cache):
    # fork: the children inherit TRANSFORMER_CACHE_DIR and start in milliseconds; they run no tensor op
    context = multiprocessing.get_context("fork")
    start = context.Barrier(WRITERS)
    writers = [context.Process(target=keep_many, args=(start, w)) for w in range(WRITERS)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
    assert [w.exitcode for w in writers] == [0] * WRITERS
    kept = json.loads(timings.timings_path("shared").read_text())
    expected = {f"writer {w} key {i}" for w in range(WRITERS) for i in range(KEYS_EACH)}
    lost = expected - kept.keys()
    assert not lost, f"{len(lost)} of {len(expected)} entries lost, e.g. {sorted(lost)[:3]}"
    assert not list(cache.glob(".*.tmp"))


def test_locked_excludes_another_holder(cache):
    path = cache / "compiled" / "program.pt2"
    with timings.locked(path), open(path.with_name(path.name + ".lock")) as other:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path.with_name(path.name + ".lock")) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the block ends


def test_writers_of_one_file_use_temporary_files_of_their_own(tmp_path):
    path = tmp_path / "cache.json"
    with atomic_open(path) as outer:
        with atomic_open(path) as inner:
            inner.write(b"inner, renamed first")
        outer.write(b"outer")
    assert path.read_bytes() == b"outer"  # whole: the last rename wins, nothing of the other is mixed in
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"half a file": {"ratio": 0.', "is not JSON"),
        ("[1, 2]", "holds a JSON list"),
        ('{"key": {"seconds": 3}}', "where a timing"),
        ('{"key": 0.5}', "where a timing"),
    ],
    ids=["broken", "list", "other entries", "bare numbers"],
)
def test_a_broken_or_foreign_file_is_named_once_and_rebuilt(cache, caplog, text, problem):
    path = timings.timings_path("int8")
    path.write_text(text)
    with caplog.at_level("WARNING", logger=timings.__name__):
        value, source = timings.kept("int8", "new key", lambda: 0.75)
        assert timings.read("int8", "new key") == 0.75  # read from the file written anew
    assert (value, source) == (0.75, "timed now")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(path) in warnings[0] and problem in warnings[0]
    assert json.loads(path.read_text()).keys() == {"new key"}


def test_a_missing_file_is_timed_without_a_word(cache, caplog):
    with caplog.at_level("WARNING"):
        assert timings.kept("fp32_linear", "key", lambda: 1.25) == (1.25, "timed now")
        assert timings.kept("fp32_linear", "key", lambda: 9.0)[0] == 1.25
    assert not caplog.records


def keys() -> tuple[str, str]:
    return int8.timing_key(255, True, (8, 16)), linear.timing_key((8, 16, 32))


def test_the_keys_name_threads_limits_and_libraries(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = keys()
        torch.set_num_threads(2)
        two = keys()
    finally:
        torch.set_num_threads(before)
    assert all(a != b for a, b in zip(one, two))
    unlimited = keys()
    other = "SSE41" if os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" else "AVX2"  # a limit other than the one set
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", other)
    assert all(a != b for a, b in zip(unlimited, keys()))
    assert all(torch.__version__ in key and "oneDNN" in key for key in unlimited)
