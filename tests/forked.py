"""Commands (train.py, translate.py, scripts/...) run as forked copies of one warm interpreter.

Each command the end-to-end tests run is its own process, with its own stdin, stdout, stderr and
exit status, started as `python SCRIPT ARGS...` starts it (the script run as __main__, its folder
first on sys.path), but forked from a server that has imported torch, Hydra and the project once:
the seconds of imports every fresh interpreter pays are paid once per test worker. The server never
runs a tensor operation, so each child starts its own thread pools.

    run(["train.py", "experiment=smoke", ...], stdin=None, timeout=600) -> subprocess.CompletedProcess
    run(["-m", "torch.distributed.run", ...])                             # python -m MODULE ...

The fresh interpreter's own start (the imports a command does itself, `python train.py` from the
shell) stays covered by the tests that still start commands with subprocess (test_cli.py's smoke
run, test_resume.py, the serving tests).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What the commands import (transformer.training's loop, the translator, Hydra, datasets, sacreBLEU, ...).
WARM = ["torch", "torch._dynamo", "hydra", "omegaconf", "datasets", "sacrebleu", "matplotlib.pyplot",
        "transformer.config", "transformer.training.launch", "transformer.translator", "transformer.evaluation"]  # fmt: skip


# --- The server: `python tests/forked.py`, one JSON request per line on stdin, one reply per line ---


def child(argv: list[str], stdin: str, out: str, err: str, env: dict[str, str]) -> None:
    """In the forked child: `env` into os.environ, fds 0-2 onto the files, run the script as
    __main__, exit as python would."""
    os.environ.update(env)
    for fd, path, flags in ((0, stdin, os.O_RDONLY), (1, out, os.O_WRONLY), (2, err, os.O_WRONLY)):
        os.dup2(os.open(path, flags), fd)
    encoding = sys.stdout.encoding
    sys.stdin = open(0, encoding=encoding, closefd=False)
    sys.stdout = open(1, "w", encoding=encoding, closefd=False)
    sys.stderr = open(2, "w", encoding=encoding, errors="backslashreplace", closefd=False, buffering=1)
    os.chdir(ROOT)
    if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator anew (random reseeds itself)
        sys.modules["numpy"].random.seed()
    code = 0
    try:
        if argv[0] == "-m":  # as `python -m MODULE ARGS...`: the current directory first on sys.path
            sys.argv, sys.path[0] = argv[1:], str(ROOT)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # as `python SCRIPT ARGS...`: the script's folder first on sys.path
            sys.argv, sys.path[0] = list(argv), str((ROOT / argv[0]).parent)
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    except SystemExit as e:
        code = exit_status(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # as the interpreter ends: non-daemon threads first, then atexit
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def wait(pid: int, timeout: float) -> tuple[int, bool]:
    """The child's status as subprocess reports it (-signal when killed), and whether it ran past
    the timeout (then it was killed)."""
    fd = os.pidfd_open(pid)
    try:
        timed_out = not select.select([fd], [], [], timeout)[0]
        if timed_out:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), timed_out


def serve() -> None:
    for name in WARM:
        __import__(name)
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints of the server stay out of the replies
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        tmp = tempfile.mkdtemp()  # not TemporaryDirectory: its finalizer would run at the child's exit
        stdin, out, err = (os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr"))
        Path(stdin).write_text(request["stdin"] or "", encoding="utf-8")
        Path(out).touch()
        Path(err).touch()
        pid = os.fork()
        if pid == 0:
            reply.close()
            child(request["argv"], stdin, out, err, request["env"])
        status, timed_out = wait(pid, request["timeout"])
        texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in (out, err)]
        shutil.rmtree(tmp)
        answer = {"returncode": status, "timed_out": timed_out, "stdout": texts[0], "stderr": texts[1]}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


# --- The client, in the test process ---

_server: subprocess.Popen | None = None
_lock = threading.Lock()


def _start() -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, str(Path(__file__))], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, encoding="utf-8")  # fmt: skip
    assert server.stdout.readline() == "ready\n", "the fork server did not start"
    atexit.register(_stop, server)
    return server


def _stop(server: subprocess.Popen) -> None:
    """At the test process's exit: the server ends when its stdin does."""
    server.stdin.close()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def run(argv: list[str], stdin: str | None = None, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """`python *argv` run from the repository root, forked from the warm server; argv[0] is the
    script, relative to the root, or "-m" before a module. `env`: variables set for the command
    only, over the server's environment (the test process's when the server started); a variable
    read when torch or another warm module is imported (ATEN_CPU_CAPABILITY, OMP_NUM_THREADS) has
    been read already. Returns what subprocess.run(..., capture_output=True, text=True) would."""
    global _server
    with _lock:
        if _server is None or _server.poll() is not None:
            _server = _start()
        request = {"argv": [str(a) for a in argv], "stdin": stdin, "timeout": timeout, "env": env or {}}
        _server.stdin.write(json.dumps(request) + "\n")
        _server.stdin.flush()
        reply = json.loads(_server.stdout.readline())
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, reply["stdout"], reply["stderr"])
    return subprocess.CompletedProcess([sys.executable, *argv], reply["returncode"], reply["stdout"], reply["stderr"])


if __name__ == "__main__":
    serve()
