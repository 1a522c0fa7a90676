"""The continuous scheduler (scheduler=continuous): requests hand their sentences to the
step-level engine (decoding/engine.py) that a worker thread runs off the event loop. A request's sentences
join the running batch at the next step, each leaves as soon as it ends, and the request is
answered when its last one has. The request-level Batcher (batcher.py) offers the same methods,
so the app takes either. A failure in the thread (batcher.py: DecodingThread) answers every request
in the engine with a 500, the engine drops their sentences and the thread serves on, unless that
leaves the engine holding sentences or blocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..decoding import DecodeConfig, Hypothesis
from ..decoding.engine import AdmissionFailed, Engine, Sentence
from ..decoding.strategies import empty_n_best
from .batcher import Answer, DecodingFailed, DecodingThread, Job, resolve, run_calls, take_all


@dataclass
class Request(Job):
    """A request-level Job on its way through the engine, and its sentences' progress."""

    n_best: list = field(default_factory=list)
    left: int = 0  # sentences not yet ended
    started_at: float | None = None  # when its first sentence joined the batch
    batch_sentences: int = 0  # the most sentences in the batch while it ran
    batch_requests: int = 0  # and the most requests
    failed: bool = False  # answered with an error: its other sentences leave

    def gone(self) -> bool:
        """Whether its sentences are to leave the engine: it failed, or its future is done (the
        app cancels it when the client disconnects)."""
        return self.failed or self.future.done()


class ContinuousBatcher(DecodingThread):
    """The engine and the requests on their way in; `on_step(sentences)` is called after each
    decoding step with the sentences it ran, `on_done(sentences)` when a request is answered."""

    def __init__(self, engine: Engine, eos_id: int, join_tokens: int, max_queue: int, on_step=None, on_done=None):
        self.engine, self.eos_id, self.join_tokens = engine, eos_id, join_tokens
        self.on_step: Callable[[int], None] = on_step or (lambda sentences: None)
        self.on_done: Callable[[int], None] = on_done or (lambda sentences: None)
        self.incoming: list[Request] = []
        self.open: dict[int, Request] = {}  # taken from `incoming` and not answered yet, by id
        super().__init__(max_queue)

    def __len__(self) -> int:
        """Requests with a sentence that has not joined the batch yet."""
        waiting = {id(s.request) for s in list(self.engine.waiting)}
        return len(self.incoming) + len(waiting)

    async def translate(self, sources: list[list[int]], settings: DecodeConfig) -> Answer:
        request = Request(sources, settings, asyncio.get_running_loop().create_future())
        return await self.enqueue(self.incoming, request, request.future)

    def turn(self) -> bool:
        with self.changed:
            while not self.incoming and not self.calls and not self.engine.busy and not self.closing:
                self.changed.wait()
            if not self.incoming and not self.calls and not self.engine.busy:
                return False
            # Emptied in place, never replaced: a request appends to the list it read before
            # taking the lock (enqueue), which must still be the one this thread reads next.
            incoming = take_all(self.incoming)
            calls = take_all(self.calls)
            self.open.update((id(request), request) for request in incoming)
        run_calls(calls)
        if not incoming and not self.engine.busy:
            return True
        for request in incoming:
            self.hand_over(request)
        try:
            running = self.engine.step(self.join_tokens)
        except AdmissionFailed as e:  # the joining sentences fail; the batch runs on
            self.fail({id(s.request): s.request for s in e.sentences}.values(), e.error)
            return True
        if running:
            self.on_step(running)
            self.note_batch(running)
        return True

    def recover(self, error: DecodingFailed) -> None:
        """Every request taken fails with `error`: the engine drops their sentences (as it drops a
        client's that went away), then they are answered. Raises, answering none, when the engine
        still holds sentences or blocks."""
        requests = list(self.open.values())
        for request in requests:
            request.failed = True
        self.engine.drop_cancelled()
        engine, pool = self.engine, self.engine.pool
        in_use = max(pool.n_blocks - len(pool.free), sum(1 for refs in pool.refs if refs))
        if engine.busy or in_use:
            sentences = len(engine.running) + len(engine.waiting)
            raise RuntimeError(f"{error}, and the engine still holds {sentences} sentences and {in_use} of its {pool.n_blocks} blocks")  # fmt: skip
        self.fail(requests, error)

    def held(self) -> list[asyncio.Future]:
        return [request.future for request in list(self.open.values()) + take_all(self.incoming)]

    def note_batch(self, running: int) -> None:
        """When each running request started, and the largest batch it ran in."""
        now, requests = time.perf_counter(), {id(s.request): s.request for s in self.engine.running}
        for request in requests.values():
            request.started_at = request.started_at or now
            request.batch_sentences = max(request.batch_sentences, running)
            request.batch_requests = max(request.batch_requests, len(requests))

    def hand_over(self, request: Request) -> None:
        """A request's sentences into the engine's queue; an empty one ends at once."""
        request.n_best = [None] * len(request.sources)
        request.left = len(request.sources)
        empty = empty_n_best(request.settings)
        try:
            for i, ids in enumerate(request.sources):
                if not ids:
                    self.finish(request, i, empty)
                    continue
                done = self.done_callback(request, i)
                # A request that is gone (failed, or its client went away) takes its sentences out.
                self.engine.add(Sentence(ids + [self.eos_id], request.settings, done, request.gone, request))
        except ValueError as e:  # a sentence that could never fit in the pool
            self.fail([request], e)

    def done_callback(self, request: Request, i: int):
        def done(n_best: list[Hypothesis]) -> None:
            self.finish(request, i, n_best)

        return done

    def finish(self, request: Request, i: int, n_best: list[Hypothesis]) -> None:
        now = time.perf_counter()
        if request.started_at is None:
            request.started_at = now
        request.n_best[i] = n_best
        request.left -= 1
        if request.left:
            return
        queue_ms = (request.started_at - request.queued_at) * 1000
        decode_ms = (now - request.started_at) * 1000
        answer = Answer(request.n_best, queue_ms, decode_ms, request.batch_sentences, request.batch_requests)
        resolve(request.future, answer)
        self.open.pop(id(request), None)  # answered: a failure from here on is not its own
        self.on_done(len(request.sources))

    def fail(self, requests, error: Exception) -> None:
        """Answer requests with an error; their sentences still in the engine leave at the next step."""
        for request in requests:
            request.failed = True
            self.open.pop(id(request), None)
            resolve(request.future, error=error)
