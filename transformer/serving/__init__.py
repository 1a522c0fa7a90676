"""Serving translations over HTTP: requests merged into decoding batches, limits on what a request
may ask, Prometheus metrics and a small web page. serve.py at the repository root composes the
config, loads the model as a transformer.translator.Translator and runs the app; nothing here
imports Hydra.

    config.py      ServeLimits: what one request may ask and how requests are batched
    batcher.py     the queue and the worker thread that decodes merged batches off the event loop
    protocol.py    a request body -> checked texts and settings, or a RequestError naming the problem
    metrics.py     the Prometheus counters and histograms of one app
    app.py         the FastAPI app: /v1/translate, /v1/align, /health, /metrics and the page at /
    server.py      uvicorn on a bound socket; SIGTERM drains the requests in flight and returns
    static/        the web page: HTML, CSS and plain JavaScript, no build step
"""

from .app import create_app
from .batcher import Batcher, QueueFull
from .config import ServeLimits
from .server import run

__all__ = ["Batcher", "QueueFull", "ServeLimits", "create_app", "run"]
