"""Serve translations over HTTP: a JSON API with dynamic batching, Prometheus metrics and a web page.

    python serve.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt            # http://127.0.0.1:8000/
    python serve.py checkpoint=PATH port=8080 host=0.0.0.0 decode.beam_size=4 limits.max_wait_ms=10

Arguments (key=value and config groups, composed by Hydra from configs/ as for translate.py):
    checkpoint=PATH  ensemble=[PATH,...]  device=auto|cpu|cuda  runtime=fast|reference
    decode=beam|greedy|sample, decode.*   runtime.precision=int8 serves the int8 model (CPU)
    host=127.0.0.1 port=8000    port=0 picks a free port (the log line "serving on" names it)
    limits.max_lines=64         sentences per request        limits.max_chars=2000  characters per sentence
    limits.max_queue=256        waiting requests (429 past)  limits.max_beam_size=8
    limits.max_sentence_tokens=0  source tokens per sentence (413 past; 0: the model's positions)
    scheduler=batch|continuous    batch: whole requests are merged into decoding batches; continuous: sentences
                                  join and leave the running batch at every step, on a paged key/value cache
                                  (as translate.py's; what it cannot run falls back to batch, /health says why)
    scheduler.pool_mib=256  scheduler.block_size=16   the continuous scheduler's key/value pool (allocated at start)
    limits.max_batch_tokens=4096  source tokens that join a batch at once (batch: per batch)
    limits.max_wait_ms=5          batch: how long the oldest request waits for others to join its batch
    access_log=false            uvicorn's line per request
    drain_seconds=30            after SIGTERM, how long the requests in flight may take before they are cut
Endpoints: POST /v1/translate, POST /v1/align, GET /health, GET /metrics, GET / (docs/SERVING.md).
SIGTERM or Ctrl-C: finish the requests in flight, then exit 0. If the decoding thread cannot go on
(docs/SERVING.md), the requests get a 503, /health turns 503, and serve.py exits 1.
"""

from __future__ import annotations

import logging
import math
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from transformer.cli import parse_args, setup_logging
from transformer.decoding import DecodeConfig
from transformer.decoding.config import SchedulerConfig
from transformer.errors import ConfigError, exit_on_user_error
from transformer.runtime import RuntimeConfig
from transformer.serving import ServeLimits, create_app, run
from transformer.translator import Translator

log = logging.getLogger("serve")


@dataclass
class ServeConfig:
    checkpoint: str = "???"
    ensemble: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    access_log: bool = False
    drain_seconds: float = 30.0
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    limits: ServeLimits = field(default_factory=ServeLimits)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is not in 0..65535")
        if not 0 <= self.drain_seconds < math.inf:
            raise ValueError(f"drain_seconds={self.drain_seconds} must be >= 0 and finite")


def listen(host: str, port: int) -> socket.socket:
    """A bound socket, so that a port in use is one error line before the model loads."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:  # socket.gaierror is one
        raise ConfigError(f"cannot listen on host={host} port={port}: {e.strerror or e}") from None
    return sock


def prepare(cfg: ServeConfig):
    translator = Translator.load(cfg.checkpoint, cfg.ensemble, cfg.device, cfg.decode, cfg.runtime)
    return translator, create_app(translator, cfg.limits, cfg.scheduler)


def off_the_main_thread(fn, *args):
    """fn(*args) in a thread that ends with it. The model loads (and the key/value pool fills) there,
    so that the main thread, which lives as long as the server, never runs torch's parallel loops:
    the decoding thread then keeps the only pool of OpenMP threads (transformer/serving/batcher.py:
    run_calls says why that matters)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="loader") as loader:
        return loader.submit(fn, *args).result()


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, ServeConfig, __doc__, "serve")
        sock = listen(cfg.host, cfg.port)
        translator, app = off_the_main_thread(prepare, cfg)
    host, port = sock.getsockname()[:2]
    where = f"{translator.device}, runtime.precision={translator.precision}, scheduler={app.state.service.scheduler}"
    log.info("serving %s on http://%s:%d/ (%s)", translator.language_pair or "a model", host, port, where)
    stopped = run(app, sock, cfg.access_log, cfg.drain_seconds)
    if stopped:
        log.error("serve.py exits: %s", stopped)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
