"""The FastAPI app: POST /v1/translate and /v1/align, GET /health and /metrics, and the web page at
/ (static/). Refused requests get {"error": message, "kind": kind} with a 4xx status, are logged
once and counted; the server keeps serving. Requests the decoding thread failed get the same with
a 500 (503 once it has stopped, when /health turns 503 too)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from ..decoding.config import SchedulerConfig
from ..errors import ConfigError
from ..translator import Translator
from .batcher import Answer, Batcher, DecodingFailed, QueueFull
from .config import ServeLimits
from .continuous import ContinuousBatcher
from .metrics import Metrics
from .protocol import RequestError, TranslateRequest, align_request, read_json, translate_request

log = logging.getLogger("serve")
STATIC = Path(__file__).parent / "static"
PATHS = ("/", "/v1/translate", "/v1/align", "/health", "/metrics")
CHECK_SENTENCE = "Hello."  # what the readiness check decodes
T = TypeVar("T")


def create_app(translator: Translator, limits: ServeLimits, schedule: SchedulerConfig | None = None) -> FastAPI:
    service = Service(translator, limits, schedule or SchedulerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.batcher.start()
        check = asyncio.create_task(service.check_model())  # /health answers 503 until it is done
        yield
        service.batcher.close()  # uvicorn has answered every request in flight by now
        await check

    app = FastAPI(title="Transformer translation", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.middleware("http")(service.count)
    add_error_handlers(app, service.metrics)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.post("/v1/translate")(service.translate)
    app.post("/v1/align")(service.align)
    app.get("/health")(service.health)
    app.get("/metrics")(service.prometheus)
    app.get("/")(service.page)
    return app


class Service:
    """What the endpoints share: the model, the batcher in front of it, the limits and the metrics.
    `model_loaded` turns true once the model has decoded a sentence (`model_error` if it could not)."""

    def __init__(self, translator: Translator, limits: ServeLimits, schedule: SchedulerConfig):
        self.translator, self.limits, self.metrics = translator, limits, Metrics()
        self.scheduler, self.batcher, self.fallback = scheduler(translator, limits, schedule, self.metrics)
        self.model_loaded, self.model_error = False, None

    @property
    def stopped(self) -> str | None:
        """Why the decoding thread stopped for good (nothing can be decoded any more), or None."""
        return self.batcher.stopped

    async def check_model(self) -> None:
        """Decode one sentence through the scheduler that serves, as a request is decoded (the
        continuous engine's steps, or translate_batch); the server is ready once it has."""
        try:
            await self.check_sentence()
        except Exception as e:
            self.model_error = f"{type(e).__name__}: {e}"
            log.error("the model cannot decode; /health answers 503: %s", self.model_error, exc_info=e)
            return
        self.model_loaded = True
        log.info("the model decodes: ready")

    async def check_sentence(self) -> None:
        """Raises when the check sentence cannot be decoded: an error, no hypothesis (a model with
        NaN weights ends none), or a log-probability that is not a finite number."""
        t = self.translator
        sources = t.encode([CHECK_SENTENCE], t.target_languages[0] if t.target_languages else None)
        if not sources[0]:
            raise RuntimeError(f"the tokenizer encodes the check sentence {CHECK_SENTENCE!r} to no tokens")
        if isinstance(self.batcher, ContinuousBatcher):  # through the engine's steps, as its requests
            n_best = (await self.batcher.translate(sources, t.decode)).n_best
        else:  # the request scheduler's decode, without waiting in its queue for a batch to fill
            n_best = await self.batcher.call(self.batcher.decode, sources, t.decode)
        log_probs = [h.log_prob for h in n_best[0]]
        if not log_probs or not all(math.isfinite(p) for p in log_probs):
            raise RuntimeError(f"the check sentence {CHECK_SENTENCE!r} decoded to {len(log_probs)} hypotheses, log-probabilities {log_probs}")  # fmt: skip

    async def count(self, request: Request, call_next) -> Response:
        """Count every answer by path and status; a bug of ours is logged once and answered 500."""
        try:
            response = await call_next(request)
        except Exception as e:
            log.error("500 %s %s", request.method, request.url.path, exc_info=e)
            self.metrics.errors.labels("internal").inc()
            response = JSONResponse({"error": f"internal error: {type(e).__name__}: {e}", "kind": "internal"}, 500)
        path = request.url.path if request.url.path in PATHS else "other"
        self.metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    async def translate(self, request: Request) -> JSONResponse:
        arrived = time.perf_counter()
        req = translate_request(read_json(await read_body(request, self.limits), self.limits), self.limits)
        answer = await unless_disconnected(request, self.decode(req))
        self.metrics.latency.observe(time.perf_counter() - arrived)
        return JSONResponse(translate_response(self.translator, req, answer, arrived))

    async def align(self, request: Request) -> JSONResponse:
        req = align_request(read_json(await read_body(request, self.limits), self.limits), self.limits)
        translation = req.translation
        if translation is None:
            answer = await unless_disconnected(request, self.decode(TranslateRequest([req.text], target_lang=req.target_lang)))  # fmt: skip
            translation = self.translator.texts(answer.n_best[0])[0]
        self.tag(req.target_lang)
        try:
            result = await self.batcher.call(self.translator.cross_attention, req.text, translation, req.layer, req.target_lang)  # fmt: skip
        except ValueError as e:
            raise RequestError(422, "out_of_range", str(e)) from None
        return JSONResponse({"source": req.text, "translation": translation, **result})

    async def decode(self, req: TranslateRequest) -> Answer:
        """The request's n-best lists from the batcher (429 when its queue is full, 413 for a
        sentence over limits.max_sentence_tokens)."""
        try:
            settings = self.translator.settings(req.beam_size, req.n_best, req.length_penalty)
        except ValueError as e:  # a combination the decode settings refuse, such as n_best > beam_size
            raise RequestError(422, "out_of_range", str(e).replace("decode.", "")) from None
        self.tag(req.target_lang)
        sources = self.translator.encode(req.texts, req.target_lang)
        most = self.limits.sentence_tokens(self.translator.max_source_tokens)
        for i, ids in enumerate(sources):
            if len(ids) > most:
                raise RequestError(413, "line_too_long", f"text[{i}] has {len(ids)} tokens; at most {most}")
        try:
            return await self.batcher.translate(sources, settings)
        except QueueFull as e:
            raise RequestError(429, "queue_full", str(e)) from None

    def tag(self, target_lang: str | None) -> None:
        """A target_lang the model cannot translate into (or a many-to-many model's missing one) is a 422."""
        try:
            self.translator.target_tag(target_lang)
        except ConfigError as e:
            raise RequestError(422, "target_lang", str(e).replace("tgt_lang=", "target_lang=")) from None

    async def health(self) -> JSONResponse:
        """Readiness: 200 once the model has decoded a sentence; 503 before ("loading"), when it
        could not and once the decoding thread has stopped ("error", with the error)."""
        t = self.translator
        error = self.stopped or self.model_error
        ready = self.model_loaded and not error
        status = "ok" if ready else "error" if error else "loading"
        body = {
            "status": status,
            "model_loaded": self.model_loaded,
            "device": str(t.device),
            "language_pair": t.language_pair,
            "target_languages": t.target_languages,
            "decoder_layers": t.n_layers,
            "queue": len(self.batcher),
            "precision": t.precision,
            "scheduler": self.scheduler,
            **({"scheduler_fallback": self.fallback} if self.fallback else {}),
            "decode": {k: getattr(t.decode, k) for k in ("strategy", "beam_size", "n_best", "length_penalty")},
            "limits": asdict(self.limits),
        }
        if isinstance(self.batcher, ContinuousBatcher):
            engine = self.batcher.engine
            pool = engine.pool
            body["pool"] = {"blocks": pool.n_blocks, "block_size": pool.block_size, "free": len(pool.free), "most_used": pool.most_used, "preemptions": engine.preemptions, "steps": engine.steps}  # fmt: skip
        if error:
            body["error"] = error
        return JSONResponse(body, 200 if ready else 503)

    async def prometheus(self) -> Response:
        self.metrics.queue.set(len(self.batcher))
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def page(self) -> FileResponse:
        return FileResponse(STATIC / "index.html")


def scheduler(translator: Translator, limits: ServeLimits, schedule: SchedulerConfig, metrics: Metrics) -> tuple[str, object, str | None]:  # fmt: skip
    """The scheduler asked for, or the batch scheduler where continuous batching cannot run this
    model or these settings (Translator.continuous_engine: the same policy as translate.py's):
    its name, the batcher, and why continuous batching was not used when it was asked for."""
    longest = limits.sentence_tokens(translator.max_source_tokens)
    engine = translator.continuous_engine(schedule, limits.max_beam_size, "limits.max_beam_size", source_tokens=longest, length_key="limits.max_sentence_tokens")  # fmt: skip
    if engine is not None:
        batcher = ContinuousBatcher(engine, translator.tokenizer.eos_id, limits.max_batch_tokens, limits.max_queue, metrics.step, metrics.sentences.inc)  # fmt: skip
        return "continuous", batcher, None
    fallback = f"scheduler=continuous cannot run here: {translator.fallback}" if schedule.kind == "continuous" else None
    batcher = Batcher(translator.translate_batch, limits.max_batch_tokens, limits.max_wait_ms / 1000, limits.max_queue, metrics.batch)  # fmt: skip
    return "batch", batcher, fallback


def translate_response(translator: Translator, req: TranslateRequest, answer: Answer, arrived: float) -> dict:
    body = {"translations": translator.texts([hyps[0] for hyps in answer.n_best])}
    if req.scores:
        body["scores"] = [hyps[0].score for hyps in answer.n_best]
    if req.n_best is not None:
        body["n_best"] = [
            [{"translation": text, "score": h.score} for text, h in zip(translator.texts(hyps), hyps)]
            for hyps in answer.n_best
        ]
    body["timing"] = {
        "total_ms": round((time.perf_counter() - arrived) * 1000, 3),
        "queue_ms": round(answer.queue_ms, 3),
        "decode_ms": round(answer.decode_ms, 3),
        "batch_sentences": answer.batch_sentences,
        "batch_requests": answer.batch_requests,
    }
    return body


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (with the
    batcher's future it waits on, so its sentences leave the batch) and the answer is a 499 nobody
    reads. uvicorn does not cancel a handler whose client has gone. Called once the body has been
    read, when the only message left to receive is the disconnect."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        raise RequestError(499, "client_gone", "the client disconnected before its answer was ready")
    return task.result()


async def disconnected(request: Request) -> None:
    """Returns when the client has disconnected (the body read, nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limits: ServeLimits) -> bytes:
    """The body, refused (413) as soon as it is longer than the limits allow, declared or not."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise RequestError(413, "too_large", f"the request body has {declared} bytes; at most {limits.max_body_bytes}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limits.max_body_bytes:
            raise RequestError(413, "too_large", f"the request body has over {limits.max_body_bytes} bytes")
    return bytes(body)


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def refuse(request: Request, status: int, kind: str, message: str) -> JSONResponse:
        log.warning("%d %s %s: %s", status, request.method, request.url.path, message)
        metrics.errors.labels(kind).inc()
        return JSONResponse({"error": message, "kind": kind}, status_code=status)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError) -> JSONResponse:
        return refuse(request, e.status, e.kind, str(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return refuse(request, e.status_code, "http", str(e.detail))

    @app.exception_handler(DecodingFailed)  # the decoding thread logged the traceback, once for all
    async def decoding_failed(request: Request, e: DecodingFailed) -> JSONResponse:
        return refuse(request, e.status, e.kind, str(e))
