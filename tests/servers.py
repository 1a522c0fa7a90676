"""What the serving tests share: a small checkpoint built in the test (a tokenizer trained on a
slice of Multi30k, a model with sharpened random weights so translations end at varied lengths)
serve.py running in a subprocess on a free port, and the checkpoint loaded in this process."""

from __future__ import annotations

import gzip
import inspect
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from transformer import checkpoint
from transformer.data.tokenizer import Tokenizer
from transformer.decoding import DecodeConfig
from transformer.model import ModelConfig, Transformer
from transformer.translator import Translator

from .conftest import DATA, ROOT

QUICK = ["decode.max_len_b=6", "decode.max_len_a=0.5", "device=cpu"]  # short translations: fast tests


def corpus_lines(lang: str, n: int, split: str = "train") -> list[str]:
    with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [next(f).strip() for _ in range(n)]


def build_checkpoint(path: Path, seed: int = 0, directions: tuple[str, ...] = ()) -> Path:
    """A de->en checkpoint that loads like a trained one: joint tokenizer, 2+2 layers, d_model 32;
    with `directions` (e.g. ("de-en", "de-fr")) a many-to-many one, a tag per target language."""
    tags = [f"<2{name.split('-')[1]}>" for name in directions]
    tokenizer = Tokenizer.train(corpus_lines("de", 300) + corpus_lines("en", 300), 300, "unigram", symbols=tags)
    torch.manual_seed(seed)
    cfg = ModelConfig(len(tokenizer), n_encoder_layers=2, n_decoder_layers=2, d_model=32, n_heads=4, d_ff=64,
                      dropout=0.0, max_positions=128)  # fmt: skip
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.embed.embed.weight.mul_(3.0)
    train_config = {"data": {"src_lang": "de", "tgt_lang": "en", "directions": list(directions)}}
    checkpoint.save(path, model, tokenizer, train_config, step=1)
    return path


def loaded_translator(model_path: Path) -> Translator:
    """The checkpoint's model in this process (the reference runtime), with short translations."""
    model, tokenizer, _ = checkpoint.load_model(model_path, torch.device("cpu"))
    return Translator(model, tokenizer, "cpu", DecodeConfig(max_len_a=0.5, max_len_b=6))


DUMPABLE = (
    "import faulthandler, runpy, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def break_the_decoding_thread() -> None:
    """For Server(inject=...): serve.py's decoding thread breaks outside decoding itself where a
    request with length_penalty 0.25 or 0.75 runs: the hook called after a continuous step
    (on_step) or a batch (on_batch) raises. At 0.25 the thread recovers; at 0.75 it cannot: the
    continuous engine is left holding a block, the batch scheduler's recovery raises."""
    from transformer.serving.batcher import Batcher
    from transformer.serving.continuous import ContinuousBatcher

    def poisoned(batcher) -> set[float]:
        """The poisoned length penalties among the requests of the step or batch that just ran."""
        if isinstance(batcher, ContinuousBatcher):
            settings = [sentence.settings for sentence in batcher.engine.running]
        else:
            settings = [job.settings for job in batcher.current]
        return {s.length_penalty for s in settings} & {0.25, 0.75}

    def breaking(batcher, hook):
        def broken(sentences: int) -> None:
            if 0.75 in poisoned(batcher) and isinstance(batcher, ContinuousBatcher):
                batcher.engine.pool.allocate()  # a block nothing gives back
            if poisoned(batcher):
                raise RuntimeError(f"injected: the hook broke at length_penalty {min(poisoned(batcher))}")
            hook(sentences)

        return broken

    def recover(self, error, recover=Batcher.recover) -> None:
        if 0.75 in poisoned(self):
            raise RuntimeError("injected: the recovery broke")
        recover(self, error)

    for cls, hook in ((ContinuousBatcher, "on_step"), (Batcher, "on_batch")):

        def init(self, *args, init=cls.__init__, hook=hook, **kwargs) -> None:
            init(self, *args, **kwargs)
            setattr(self, hook, breaking(self, getattr(self, hook)))

        cls.__init__ = init
    Batcher.recover = recover


class Server:
    """serve.py in a subprocess on a free port; `url` once it listens. The log lines of its stderr
    are collected in `log` by a thread, so that a full pipe never stalls it. `inject`, a function
    that imports what it uses, runs in that process before serve.py (break_the_decoding_thread)."""

    def __init__(self, *args: str, env: dict | None = None, inject: Callable[[], None] | None = None):
        # serve.py as run from a shell, with Python's stack dump of every thread on SIGUSR1
        # (`dump_threads`: what a hung server was doing, for the report of the test that waited)
        code = DUMPABLE if inject is None else f"{inspect.getsource(inject)}\n{inject.__name__}()\n{DUMPABLE}"
        command = [sys.executable, "-c", code, "serve.py", "port=0", *args]
        environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        self.process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=environ)
        self.log: list[str] = []
        self.url: str | None = None
        self.listening = threading.Event()
        threading.Thread(target=self.read_log, daemon=True).start()

    def read_log(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            found = re.search(r"on (http://[\d.]+:\d+)/", line)
            if found:
                self.url = found.group(1)
            if "Application startup complete" in line or "Uvicorn running" in line:
                self.listening.set()
        self.listening.set()  # it exited

    def dump_threads(self, seconds: float = 2) -> None:
        """Ask a running server for its threads' stacks; they reach `log` through its stderr."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)
            time.sleep(seconds)

    def wait(self, timeout: float = 120) -> Server:
        if not self.listening.wait(timeout) or self.url is None or self.process.poll() is not None:
            self.stop()
            raise RuntimeError("serve.py did not start:\n" + "".join(self.log)[-3000:])
        return self

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout)

    def __enter__(self) -> Server:
        return self.wait()

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc is not None:  # a test failed talking to it: its threads' stacks and its log go with the error
            self.dump_threads()
            exc.add_note("serve.py log, ending with its threads' stacks if it still ran:\n" + "".join(self.log[-200:]))
        self.stop()
        if self.process.poll() is None:
            self.process.kill()


def wait_for(predicate, timeout: float = 10, every: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


def translate_py(*args: str, stdin: str) -> subprocess.CompletedProcess:
    """translate.py run as the server runs: a subprocess with one torch thread."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "translate.py", *args]
    return subprocess.run(command, cwd=ROOT, input=stdin, capture_output=True, text=True, env=environ, timeout=300)


def load_entry(script: str):
    """serve.py or a script (scripts/NAME.py, benchmarks/NAME.py) as a module of this process."""
    import importlib.util

    name = "entry_" + script.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, ROOT / script)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def run_entry(script: str, argv: list[str]) -> int:
    """The exit status of main(argv) of serve.py or a script, run in this process."""
    module = load_entry(script)
    try:
        module.main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0
