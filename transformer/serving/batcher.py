"""Dynamic batching: requests wait in one queue; a worker thread takes the oldest request and
every waiting request with the same decode settings (up to max_batch_tokens source tokens, after
waiting at most max_wait for more to arrive), decodes them as one batch off the event loop, and
answers each request's future with its own sentences. A batch that fails is retried request by
request, so one bad request fails alone. The thread itself (`DecodingThread`: its lock, closing,
the other torch work queued for it and what happens when it fails) is the continuous scheduler's
too (continuous.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..decoding import DecodeConfig, Hypothesis

log = logging.getLogger("serve")


class QueueFull(Exception):
    """The queue holds max_queue requests already."""


class DecodingFailed(Exception):
    """The decoding thread failed while it held the request; the thread logged the traceback once,
    and the app answers `status` with the message."""

    status, kind = 500, "decoding_failed"


class DecoderStopped(DecodingFailed):
    """The decoding thread has stopped for good: no request can be decoded any more."""

    status, kind = 503, "decoder_stopped"


@dataclass
class Job:
    """One request's sentences (token ids) and settings, and the future its answer goes to."""

    sources: list[list[int]]
    settings: DecodeConfig
    future: asyncio.Future
    queued_at: float = field(default_factory=time.perf_counter)

    @property
    def tokens(self) -> int:
        return sum(len(s) + 1 for s in self.sources)

    @property
    def key(self) -> tuple:
        return dataclasses.astuple(self.settings)


@dataclass
class Answer:
    """A request's n-best lists in its order, and how its batch went."""

    n_best: list[list[Hypothesis]]
    queue_ms: float
    decode_ms: float
    batch_sentences: int
    batch_requests: int


Decode = Callable[[list[list[int]], DecodeConfig], list[list[Hypothesis]]]


class DecodingThread:
    """The one thread that runs a server's torch work (why one: `run_calls`), with the lock and the
    closing flag its queues share and the calls queued for it. The subclass's `turn` waits for work
    and does it; an exception there cannot end the thread silently: the requests the turn held are
    answered with DecodingFailed (`recover`) and the thread goes on, and where that recovery itself
    fails the thread stops for good (`stop`): every request gets DecoderStopped, and `stopped`
    names the error (/health turns 503, serve.py exits 1)."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.calls: deque[tuple[Callable, asyncio.Future]] = deque()
        self.changed = threading.Condition()
        self.closing = False
        self.stopped: str | None = None  # why the thread stopped for good
        self.thread = threading.Thread(target=self.run, name="decoder", daemon=True)

    def turn(self) -> bool:
        """Wait for work and do it; False once closing with nothing left."""
        raise NotImplementedError

    def recover(self, error: DecodingFailed) -> None:
        """Answer the requests the failed turn held with `error`; raise when the thread cannot go on."""
        raise NotImplementedError

    def held(self) -> list[asyncio.Future]:
        """The futures of every request taken from the queues and not answered yet."""
        raise NotImplementedError

    def run(self) -> None:
        try:
            while self.turn_safely():
                pass
        except BaseException as e:  # the recovery failed: nothing is left to go on with
            self.stop(e)

    def turn_safely(self) -> bool:
        try:
            return self.turn()
        except Exception as e:
            self.recover(DecodingFailed(f"decoding failed: {type(e).__name__}: {e}"))
            log.error("decoding failed; the requests in flight get a 500 and the server serves on", exc_info=e)
            return True

    def stop(self, error: BaseException) -> None:
        """Stop for good: answer every request, held or queued, and every call with DecoderStopped."""
        stopped = f"the decoding thread stopped: {type(error).__name__}: {error}"
        log.critical("%s; every request gets a 503 and the server exits", stopped, exc_info=error)
        with self.changed:
            self.stopped = stopped
            futures = self.held() + [future for _, future in take_all(self.calls)]
        for future in futures:
            resolve(future, error=DecoderStopped(stopped))

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """Decode what is queued or running, then stop the thread."""
        with self.changed:
            self.closing = True
            self.changed.notify()
        if self.thread.is_alive():
            self.thread.join()

    async def call(self, fn: Callable, *args):
        """fn(*args) on the decoding thread, between batches or steps."""
        future = asyncio.get_running_loop().create_future()
        with self.changed:
            if self.stopped:
                raise DecoderStopped(self.stopped)
            self.calls.append((lambda: fn(*args), future))
            self.changed.notify()
        return await future

    async def enqueue(self, queue, item, future: asyncio.Future):
        """Put a request on one of the thread's queues and wait for its answer; QueueFull when
        max_queue requests wait (len(self)) or the server is shutting down, DecoderStopped once the
        thread has stopped. The caller reads `queue` before the lock is taken, so the thread
        empties its queues and never replaces them."""
        with self.changed:
            if self.stopped:
                raise DecoderStopped(self.stopped)
            if self.closing:
                raise QueueFull("the server is shutting down")
            if len(self) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests wait); retry later")
            queue.append(item)
            self.changed.notify()
        return await future


class Batcher(DecodingThread):
    """The queue of whole requests; `on_batch(sentences)` is called after each decoded batch."""

    def __init__(self, decode: Decode, max_batch_tokens: int, max_wait_s: float, max_queue: int, on_batch=None):
        self.decode, self.max_batch_tokens, self.max_wait_s = decode, max_batch_tokens, max_wait_s
        self.on_batch = on_batch or (lambda sentences: None)
        self.pending: deque[Job] = deque()
        self.current: list[Job] = []  # the batch being decoded
        super().__init__(max_queue)

    def __len__(self) -> int:
        return len(self.pending)

    async def translate(self, sources: list[list[int]], settings: DecodeConfig) -> Answer:
        """Queue the sentences and wait for their n-best lists."""
        job = Job(sources, settings, asyncio.get_running_loop().create_future())
        return await self.enqueue(self.pending, job, job.future)

    def turn(self) -> bool:
        with self.changed:
            while not self.pending and not self.calls and not self.closing:
                self.changed.wait()
            if not self.pending and not self.calls:
                return False
            calls = take_all(self.calls)
            self.current = self.next_batch() if self.pending else []
        run_calls(calls)
        if self.current:
            self.answer(self.current)
        self.current = []
        return True

    def recover(self, error: DecodingFailed) -> None:
        for job in self.current:
            resolve(job.future, error=error)
        self.current = []

    def held(self) -> list[asyncio.Future]:
        return [job.future for job in self.current + take_all(self.pending)]

    def next_batch(self) -> list[Job]:
        """The oldest job and those queued with its settings, once their tokens fill a batch or the
        oldest has waited max_wait (called holding the lock; waiting releases it)."""
        oldest = self.pending[0]
        deadline = oldest.queued_at + self.max_wait_s
        while not self.closing and time.perf_counter() < deadline and self.tokens_like(oldest) < self.max_batch_tokens:
            self.changed.wait(deadline - time.perf_counter())
        jobs, tokens = [], 0
        for job in list(self.pending):
            if job.key == oldest.key and (not jobs or tokens + job.tokens <= self.max_batch_tokens):
                jobs.append(job)
                tokens += job.tokens
                self.pending.remove(job)
        return jobs

    def tokens_like(self, oldest: Job) -> int:
        return sum(job.tokens for job in self.pending if job.key == oldest.key)

    def answer(self, jobs: list[Job]) -> None:
        """Decode the jobs as one batch and hand each its part; on failure, each job alone."""
        started = time.perf_counter()
        try:
            n_best = self.decode([s for job in jobs for s in job.sources], jobs[0].settings)
        except Exception as e:
            if len(jobs) > 1:
                for job in jobs:
                    self.answer([job])
                return
            resolve(jobs[0].future, error=e)
            return
        decode_ms = (time.perf_counter() - started) * 1000
        sentences = sum(len(job.sources) for job in jobs)
        self.on_batch(sentences)
        for job in jobs:
            mine, n_best = n_best[: len(job.sources)], n_best[len(job.sources) :]
            queue_ms = (started - job.queued_at) * 1000
            resolve(job.future, Answer(mine, queue_ms, decode_ms, sentences, len(jobs)))


def take_all(queue: deque | list) -> list:
    """The queue's items, leaving it empty (called holding the lock)."""
    taken = list(queue)
    queue.clear()
    return taken


def run_calls(calls: list) -> None:
    """Run the queued calls, each answering its future. Every call that runs torch goes through the
    decoding thread: with GNU OpenMP, a second living thread that has run torch's parallel loops
    keeps a second pool of OpenMP threads, and once they outnumber the cores libgomp stops spinning
    between loops, which made a decoding step up to twice as slow (docs/PERFORMANCE.md)."""
    for fn, future in calls:
        try:
            resolve(future, fn())
        except Exception as e:
            resolve(future, error=e)


def resolve(future: asyncio.Future, result=None, error: Exception | None = None) -> None:
    """Set a future of the event loop from the worker thread, unless its request went away."""

    def settle() -> None:
        if future.done():  # the client disconnected and the request was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:  # the event loop has closed
        pass
