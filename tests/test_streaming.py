"""translate.py streams: it reads its input in chunks of chunk_lines and writes each chunk's
translations before reading on, so output follows a pipe while it is still open, and the result
equals translating the whole input at once."""

from __future__ import annotations

import io
import os
import pty
import queue
import subprocess
import sys
import threading

import pytest

from .conftest import ROOT
from .servers import QUICK, build_checkpoint, corpus_lines, run_entry, translate_py


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("streaming") / "model.pt")


def lines_of(stream) -> queue.Queue:
    """The lines a process writes, as they come, read by a thread (a read never blocks the test)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    return lines


def open_input(mode: str):
    """(stdin for the process, write(text), close()): a pipe, or with mode "terminal" a pseudo-terminal
    (translate.py then reads line by line without being told), closed by Ctrl-D."""
    if mode != "terminal":
        reader, writer = os.pipe()
        return reader, lambda text: os.write(writer, text.encode()), lambda: os.close(writer)
    controller, terminal = pty.openpty()
    return terminal, lambda text: os.write(controller, text.encode()), lambda: os.write(controller, b"\x04")


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["chunk_lines=2", "interactive=true", "terminal"])
def test_output_of_the_first_chunk_comes_before_stdin_closes(mode, model_path):
    source = corpus_lines("de", 5, "val")
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [] if mode == "terminal" else [mode]
    command = [sys.executable, "translate.py", f"checkpoint={model_path}", *QUICK, *args, "decode.strategy=greedy"]
    stdin, write, close = open_input(mode)
    process = subprocess.Popen(command, cwd=ROOT, stdin=stdin, stdout=subprocess.PIPE, text=True, env=environ)
    os.close(stdin)
    try:
        out = lines_of(process.stdout)
        first = 2 if mode == "chunk_lines=2" else 1
        write("".join(s + "\n" for s in source[:first]))
        early = [out.get(timeout=120) for _ in range(first)]  # stdin is still open
        assert out.empty()
        write("".join(s + "\n" for s in source[first:]))
        close()
        assert process.wait(120) == 0
        rest = []
        while len(early) + len(rest) < len(source):
            rest.append(out.get(timeout=10))
    finally:
        process.kill()
    whole = translate_py(f"checkpoint={model_path}", *QUICK, "decode.strategy=greedy", stdin="".join(s + "\n" for s in source))  # fmt: skip
    assert [line.rstrip("\n") for line in early + rest] == whole.stdout.splitlines()


def translate_here(args: list[str], stdin: str, monkeypatch, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of translate.py's main run in this process on `stdin`."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8"))
    status = run_entry("translate.py", args)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.e2e
def test_chunked_output_equals_whole_input_output_and_names_lines_across_chunks(model_path, tmp_path):
    source = [*corpus_lines("de", 6, "val"), "", " ".join(["Hund"] * 200), "Ein Hund."]
    stdin = "".join(s + "\n" for s in source)
    args = [f"checkpoint={model_path}", *QUICK, "decode.n_best=2", "decode.beam_size=3"]
    whole = translate_py(*args, "chunk_lines=1000", stdin=stdin)
    chunked = translate_py(*args, "chunk_lines=3", stdin=stdin)
    assert whole.returncode == chunked.returncode == 0, chunked.stderr
    assert chunked.stdout == whole.stdout and len(whole.stdout.splitlines()) == 2 * len(source)
    assert "stdin:8: 200 tokens, truncated to 127" in chunked.stderr  # line 8 is in the third chunk
    out = tmp_path / "out.en"
    to_file = translate_py(*args, "chunk_lines=2", f"output={out}", stdin=stdin)
    assert to_file.returncode == 0 and out.read_text() == whole.stdout


def test_a_bad_chunk_size_is_one_error_line(model_path, monkeypatch, capsys):
    status, _, err = translate_here([f"checkpoint={model_path}", "chunk_lines=0"], "Hallo\n", monkeypatch, capsys)
    assert status == 2 and err.strip() == "error: chunk_lines=0 must be >= 1"
