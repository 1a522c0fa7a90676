"""serve.py's continuous scheduler over real HTTP (scheduler=continuous): requests at random
moments into a small pool get translate.py's translations, a client that gives up costs no blocks
and has them back within a few steps; a request whose sentences cannot be encoded gets a 500 and
the engine serves on, and so does every request a failing decoding thread held (a thread that
cannot go on answers 503, /health too); /health checks the engine that serves, and says when and why the server
fell back to request scheduling (and compare_schedulers.py refuses to measure such a server); and
the rule both schedulers keep, that every piece of torch work runs on the one decoding thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from transformer.decoding.config import SchedulerConfig
from transformer.decoding.engine import Engine
from transformer.errors import ConfigError
from transformer.fast.paged import PagedKeyValueCache
from transformer.serving import ServeLimits
from transformer.serving import app as serving_app
from transformer.serving.batcher import Job
from transformer.serving.continuous import Request
from transformer.serving.metrics import Metrics
from transformer.translator import Translator

from .conftest import ROOT
from .servers import (
    QUICK,
    Server,
    build_checkpoint,
    corpus_lines,
    load_entry,
    loaded_translator,
    translate_py,
    wait_for,
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("serve") / "model.pt")


def post(server: Server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/translate", json=body, timeout=60)


async def translate_at_random_moments(url: str, bodies: list[dict], seed: int = 0) -> list[httpx.Response]:
    rng = random.Random(seed)
    delays = [rng.uniform(0, 0.6) for _ in bodies]
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def send(body: dict, delay: float) -> httpx.Response:
            await asyncio.sleep(delay)
            return await client.post("/v1/translate", json=body)

        return await asyncio.gather(*(send(body, delay) for body, delay in zip(bodies, delays)))


@pytest.mark.e2e
def test_continuous_batching_answers_as_translate_py_with_a_full_pool_and_a_client_gone(model_path):
    """Requests at random moments, at two beam sizes, into a pool that holds a few sentences at a
    time (the others wait for blocks): every answer is translate.py's. A client that gives up
    mid-decoding costs nothing: the server goes on serving, and every block returns to the pool."""
    texts = corpus_lines("de", 16, "val")
    expected = {}
    for k in (2, 4):
        done = translate_py(f"checkpoint={model_path}", *QUICK, f"decode.beam_size={k}", stdin="".join(t + "\n" for t in texts))  # fmt: skip
        assert done.returncode == 0, done.stderr
        expected[k] = done.stdout.splitlines()
    small_pool = [
        "scheduler=continuous",
        "scheduler.pool_mib=0.25",
        "scheduler.block_size=16",
        "limits.max_beam_size=4",
    ]
    with Server(f"checkpoint={model_path}", *QUICK, *small_pool) as server:
        pool = httpx.get(server.url + "/health").json()["pool"]
        assert pool["blocks"] == 32  # 8 KiB blocks; a short sentence at beam 4 takes 5, the longest 28
        bodies = [{"text": [t], "beam_size": k} for t in texts for k in (2, 4)]
        bodies += [{"text": texts[i : i + 3], "beam_size": 4} for i in range(0, 16, 3)]
        responses = asyncio.run(translate_at_random_moments(server.url, bodies))
        assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses if r.status_code != 200]  # fmt: skip
        answers = [r.json()["translations"] for r in responses]
        assert answers[: 2 * len(texts)] == [[expected[k][i]] for i in range(len(texts)) for k in (2, 4)]
        assert answers[2 * len(texts) :] == [expected[4][i : i + 3] for i in range(0, 16, 3)]

        with pytest.raises(httpx.TimeoutException):  # gives up long before 16 sentences are decoded
            httpx.post(server.url + "/v1/translate", json={"text": texts}, timeout=0.05)
        assert post(server, {"text": texts[:2], "beam_size": 4}).json()["translations"] == expected[4][:2]
        assert wait_for(lambda: httpx.get(server.url + "/health").json()["pool"]["free"] == pool["blocks"])
        health = httpx.get(server.url + "/health").json()
    assert health["pool"]["free"] == health["pool"]["blocks"] and health["scheduler"] == "continuous"


def test_torch_work_other_than_decoding_runs_on_the_decoding_thread(model_path):
    """The readiness check and alignments go through `call`, onto the one thread that decodes (two
    living threads running torch's OpenMP loops slowed decoding down to half speed); serve.py loads
    the model in a thread that has ended by the time it serves."""
    translator = Translator.load(model_path, device="cpu")

    async def threads(batcher) -> tuple[int, int, object]:
        batcher.start()
        ident = await batcher.call(threading.get_ident)
        failed = await asyncio.gather(batcher.call(translator.cross_attention, "Ein Hund.", "A dog.", 9), return_exceptions=True)  # fmt: skip
        batcher.close()
        return ident, batcher.thread.ident, failed[0]

    for kind in ("batch", "continuous"):
        _, batcher, _ = serving_app.scheduler(translator, ServeLimits(), SchedulerConfig(kind=kind, pool_mib=1), Metrics())  # fmt: skip
        ident, decoding, failed = asyncio.run(threads(batcher))
        assert ident == decoding != threading.get_ident()
        assert isinstance(failed, ValueError)  # an error reaches its caller
    module = load_entry("serve.py")
    assert module.off_the_main_thread(threading.current_thread) is not threading.current_thread()
    assert not module.off_the_main_thread(threading.current_thread).is_alive()


@pytest.mark.parametrize("kind", ["batch", "continuous"])
def test_a_request_queued_while_the_decoding_thread_takes_the_queue_is_not_lost(model_path, kind):
    """A request reads the scheduler's queue on the event loop, then appends to it under the lock;
    the decoding thread may take the queue in between. The request is decoded all the same (when
    that thread swapped in a new list, the request went into the old one, already taken, and its
    client waited forever)."""
    translator = loaded_translator(model_path)
    sources = translator.encode(corpus_lines("de", 2, "val"))
    _, batcher, _ = serving_app.scheduler(translator, ServeLimits(), SchedulerConfig(kind=kind, pool_mib=1), Metrics())  # fmt: skip
    first, second = asyncio.run(second_reads_the_queue_first(batcher, sources, translator.decode))
    assert tokens(first) == tokens(second)  # (scores may differ in their last bits: by_rows times kernels)


async def second_reads_the_queue_first(batcher, sources: list[list[int]], settings) -> list:
    """Two requests of `sources`; the second reads the queue before the first is queued, and
    appends to it once the decoding thread has taken the first."""
    queue, job = (batcher.incoming, Request) if isinstance(batcher, serving_app.ContinuousBatcher) else (batcher.pending, Job)  # fmt: skip
    batcher.start()
    first = asyncio.ensure_future(batcher.translate(sources, settings))
    await asyncio.sleep(0)  # the first is queued
    assert await async_wait_for(lambda: len(batcher) == 0)  # and taken by the decoding thread
    future = asyncio.get_running_loop().create_future()
    answers = await answer(asyncio.gather(first, batcher.enqueue(queue, job(sources, settings, future), future)))
    batcher.close()
    return answers


def tokens(answer) -> list[list[list[int]]]:
    return [[h.tokens for h in n_best] for n_best in answer.n_best]


async def async_wait_for(predicate, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


FEW_STEPS = 20  # steps a server may run before it notices a client has gone (its sentences take 100)


def health(server: Server) -> dict:
    return httpx.get(server.url + "/health", timeout=60).json()


def sentences_translated(server: Server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=60).text
    return float(re.search(r"^serve_sentences_total (\S+)$", text, re.MULTILINE).group(1))


def raw_post(server: Server, body: dict) -> socket.socket:
    """A socket that has sent a translate request, for the caller to close before the answer."""
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = f"POST /v1/translate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"  # fmt: skip
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.e2e
def test_a_client_that_disconnects_has_its_blocks_back_within_a_few_steps(model_path):
    """Sentences held to 100 tokens at beam 8 take at least 100 decoding steps. A client that closes
    its socket once they have joined the batch has their blocks back within a few steps (/health
    counts them) and they never end: uvicorn does not cancel a handler whose client has gone, so
    the app watches for it."""
    long = ["decode.min_len=100", "decode.max_len_a=0", "decode.max_len_b=110", "scheduler.pool_mib=8"]
    body = {"text": corpus_lines("de", 12, "val"), "beam_size": 8}
    with Server(f"checkpoint={model_path}", "device=cpu", "scheduler=continuous", *long) as server:
        assert wait_for(lambda: health(server)["status"] == "ok", timeout=60)
        blocks, translated = health(server)["pool"]["blocks"], sentences_translated(server)
        with raw_post(server, body):
            assert wait_for(lambda: health(server)["pool"]["free"] < blocks, every=0.005)  # they run
            before = health(server)["pool"]["steps"]  # at most the steps when the socket closes
        free = {"blocks": blocks, "block_size": 16, "free": blocks, "preemptions": 0}
        pool = lambda: {key: value for key, value in health(server)["pool"].items() if key in free}  # noqa: E731
        assert wait_for(lambda: pool() == free, timeout=120, every=0.005)
        steps = health(server)["pool"]["steps"] - before  # none run once the engine is idle
        assert steps <= FEW_STEPS, f"the blocks came back {steps} steps after the client closed its socket"
        assert sentences_translated(server) == translated  # they left unfinished
        assert post(server, {"text": body["text"][:1]}).status_code == 200


@contextlib.asynccontextmanager
async def served(app):
    """The app in this process, started (its readiness check done) and a client of it."""
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://app") as client:
            for _ in range(600):
                if (await client.get("/health")).json()["status"] != "loading":
                    break
                await asyncio.sleep(0.1)
            yield client


async def answer(response, seconds: float = 30) -> httpx.Response:
    try:
        return await asyncio.wait_for(response, seconds)
    except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
        pytest.fail(f"no answer in {seconds} s: the request was lost")


def test_a_request_whose_sentences_cannot_be_encoded_gets_a_500_and_the_engine_serves_on(model_path, monkeypatch):
    """The engine admits sentences (taking their first blocks) before their encoder pass: when that
    raises, their request is answered with the error and the blocks go back."""
    translator = loaded_translator(model_path)
    encode, texts = translator.model.encode, corpus_lines("de", 3, "val")

    def fails_once(*args, **kwargs):
        monkeypatch.setattr(translator.model, "encode", encode)
        raise RuntimeError("the encoder broke")

    async def requests() -> tuple[httpx.Response, dict, httpx.Response]:
        async with served(serving_app.create_app(translator, ServeLimits(), SchedulerConfig(kind="continuous", pool_mib=1))) as client:  # fmt: skip
            assert (await client.get("/health")).status_code == 200
            monkeypatch.setattr(translator.model, "encode", fails_once)
            failed = await answer(client.post("/v1/translate", json={"text": texts}))
            status = (await client.get("/health")).json()
            return failed, status, await answer(client.post("/v1/translate", json={"text": texts}))

    failed, status, answered = asyncio.run(requests())
    assert failed.status_code == 500 and "the encoder broke" in failed.json()["error"], failed.text
    pool = status["pool"]
    assert pool["free"] == pool["blocks"] and status["status"] == "ok"
    assert answered.status_code == 200
    assert answered.json()["translations"] == translator.texts([h[0] for h in translator.translate_batch(translator.encode(texts), translator.decode)])  # fmt: skip


def break_once(where: str, batcher, monkeypatch) -> None:
    """The continuous scheduler's thread raises once, outside the engine's encoder pass: handing a
    request's sentences to the engine, in the hook after a step, or in the one after an answer."""

    def broken(*args) -> None:
        monkeypatch.undo()
        raise RuntimeError(f"the {where} hook broke")

    if where == "hand_over":
        hand_over = batcher.hand_over
        monkeypatch.setattr(batcher, "hand_over", lambda request: hand_over(request) or broken())
    else:
        monkeypatch.setattr(batcher, where, broken)


@pytest.mark.parametrize("where", ["hand_over", "on_step", "on_done"])
def test_a_failure_in_the_decoding_thread_answers_its_requests_with_a_500_and_it_serves_on(model_path, monkeypatch, caplog, where):  # fmt: skip
    """Two requests taken by the decoding thread at once, and it raises: each request not answered
    yet gets a JSON 500 naming the error (after an answer, on_done breaks with the other request
    still running), its sentences leave the engine and every block comes back, the traceback is
    logged once, and a later request is translated. (The thread ended, and every request waited.)"""
    translator = loaded_translator(model_path)
    texts = corpus_lines("de", 3, "val")

    async def requests() -> tuple[list[httpx.Response], dict, httpx.Response]:
        app = serving_app.create_app(translator, ServeLimits(), SchedulerConfig(kind="continuous", pool_mib=1))
        async with served(app) as client:
            batcher = app.state.service.batcher
            # The thread waits in a call until both requests are queued. Waiting for it to be in the
            # call, not for an empty queue of calls: the call may not be queued yet.
            inside, held = threading.Event(), threading.Event()

            def hold() -> None:
                inside.set()
                held.wait(120)

            gate = asyncio.ensure_future(batcher.call(hold))
            assert await async_wait_for(inside.is_set)
            break_once(where, batcher, monkeypatch)
            sent = [asyncio.ensure_future(client.post("/v1/translate", json={"text": t})) for t in (texts[:2], texts[2:])]  # fmt: skip
            assert await async_wait_for(lambda: len(batcher) == 2)
            held.set()
            await gate
            failed = [await answer(response) for response in sent]
            status = (await client.get("/health")).json()
            return failed, status, await answer(client.post("/v1/translate", json={"text": texts}))

    failed, status, answered = asyncio.run(requests())
    error = {"error": f"decoding failed: RuntimeError: the {where} hook broke", "kind": "decoding_failed"}
    expected = [[200, 500], [500, 500]][where != "on_done"]
    assert sorted(r.status_code for r in failed) == expected, [r.text for r in failed]
    assert [r.json() for r in failed if r.status_code == 500] == [error] * expected.count(500)
    assert status["pool"]["free"] == status["pool"]["blocks"] and status["status"] == "ok"
    assert answered.status_code == 200, answered.text
    assert answered.json()["translations"] == translator.texts([h[0] for h in translator.translate_batch(translator.encode(texts), translator.decode)])  # fmt: skip
    assert len([record for record in caplog.records if record.exc_info]) == 1


@pytest.mark.parametrize("kind", ["batch", "continuous"])
def test_a_decoding_thread_that_cannot_go_on_answers_503_and_health_says_why(model_path, monkeypatch, kind):
    """A failure the thread cannot recover from (continuous: the engine is left holding a block;
    batch: the recovery itself raises): the request gets a JSON 503 naming the error, and so does
    every later one, /v1/align too, at once; /health turns 503 with the error."""
    translator = loaded_translator(model_path)

    def breaks(batcher) -> None:
        def broken(*args) -> None:
            if kind == "continuous":
                batcher.engine.pool.allocate()  # a block nothing gives back
            raise RuntimeError("the hook broke")

        def recovery_breaks(*args) -> None:
            raise RuntimeError("the recovery broke")

        monkeypatch.setattr(batcher, "on_step" if kind == "continuous" else "on_batch", broken)
        if kind == "batch":
            monkeypatch.setattr(batcher, "recover", recovery_breaks)

    async def requests() -> tuple[httpx.Response, httpx.Response, httpx.Response, httpx.Response]:
        app = serving_app.create_app(translator, ServeLimits(), SchedulerConfig(kind=kind, pool_mib=1))
        async with served(app) as client:
            breaks(app.state.service.batcher)
            failed = await answer(client.post("/v1/translate", json={"text": ["Ein Hund."]}))
            health = await client.get("/health")
            later = await answer(client.post("/v1/translate", json={"text": ["Ein Hund."]}))
            return failed, health, later, await answer(client.post("/v1/align", json={"text": "Ein Hund."}))

    failed, health, later, align = asyncio.run(requests())
    cause = {
        "continuous": "decoding failed: RuntimeError: the hook broke, and the engine still holds 0 sentences and 1 of its",
        "batch": "the recovery broke",
    }[kind]
    for response in (failed, later, align):
        assert response.status_code == 503 and response.json()["kind"] == "decoder_stopped", response.text
        assert response.json()["error"].startswith("the decoding thread stopped: RuntimeError: ")
        assert cause in response.json()["error"]
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert health.json()["error"] == failed.json()["error"]


def test_health_checks_the_engine_that_serves(model_path, monkeypatch):
    """Under continuous batching the readiness check decodes through the engine: with its paged
    step broken /health is a 503 with the error, though translate_batch decodes."""

    def broken(*args, **kwargs):
        raise RuntimeError("the paged step broke")

    monkeypatch.setattr(PagedKeyValueCache, "append", broken)
    translator = loaded_translator(model_path)
    with TestClient(
        serving_app.create_app(translator, ServeLimits(), SchedulerConfig(kind="continuous", pool_mib=1))
    ) as client:
        assert wait_for(lambda: client.get("/health").json()["status"] != "loading", timeout=60)
        answer = client.get("/health")
    assert answer.status_code == 503 and "the paged step broke" in answer.json()["error"], answer.json()
    assert answer.json()["scheduler"] == "continuous"
    assert translator.translate_batch(translator.encode(["Ein Hund."]), translator.decode)[0]


@pytest.mark.parametrize("cannot", ["settings", "model"])
def test_continuous_scheduling_falls_back_to_request_scheduling_and_health_says_why(model_path, cannot):
    translator = loaded_translator(model_path)
    if cannot == "settings":
        translator.decode = dataclasses.replace(translator.decode, strategy="sample")
        why = "decode.strategy=sample"
    else:
        translator = Translator.load(model_path, ensemble=[str(model_path)], device="cpu")
        why = "ensemble"
    with TestClient(serving_app.create_app(translator, ServeLimits(), SchedulerConfig(kind="continuous"))) as client:
        assert wait_for(lambda: client.get("/health").status_code == 200, timeout=60)
        status = client.get("/health").json()
        assert client.post("/v1/translate", json={"text": "Ein Hund."}).status_code == 200
    assert status["scheduler"] == "batch" and "pool" not in status
    assert status["scheduler_fallback"].startswith("scheduler=continuous cannot run here: ")
    assert why in status["scheduler_fallback"]
    with TestClient(serving_app.create_app(translator, ServeLimits(), SchedulerConfig(kind="batch"))) as client:
        assert "scheduler_fallback" not in client.get("/health").json()  # asked for batch scheduling


@pytest.mark.e2e
def test_compare_schedulers_refuses_a_server_that_fell_back(model_path, tmp_path):
    """Asked for the continuous scheduler, a server that serves with the request one (sampling:
    continuous batching runs greedy and beam search) would measure the wrong scheduler."""
    (tmp_path / "input.de").write_text("Ein Hund.\n")
    args = [f"checkpoint={model_path}", f"input={tmp_path / 'input.de'}", "schedulers=[continuous]", "clients=[1]",
            "seconds=1", "serve=['device=cpu','decode.strategy=sample']"]  # fmt: skip
    done = subprocess.run([sys.executable, "benchmarks/compare_schedulers.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error: serve.py was asked for scheduler=continuous but serves with scheduler=batch")
    assert "decode.strategy=sample" in error and not done.stdout


@pytest.mark.parametrize("kind", ["batch", "continuous"])
def test_a_sentence_over_max_sentence_tokens_is_a_413_and_the_limit_bounds_the_pool(model_path, kind):
    """limits.max_sentence_tokens refuses a longer sentence with a 413 under either scheduler, and
    the continuous pool need only hold a sentence that long: a pool too small for the longest
    sentence the model takes starts with the limit, and answers as translate_batch does."""
    translator = loaded_translator(model_path)
    texts = corpus_lines("de", 6, "val")
    lengths = [len(ids) for ids in translator.encode(texts)]
    most = sorted(lengths)[len(lengths) // 2]
    probe = Engine(translator.model, translator.tokenizer, translator.decode, "cpu", pool_bytes=1)
    pool = SchedulerConfig(kind=kind, pool_mib=probe.mib(probe.most_needed(most + 1, 8)))
    assert probe.most_needed(translator.max_source_tokens + 1, 8) > probe.most_needed(most + 1, 8)
    if kind == "continuous":
        with pytest.raises(ConfigError, match="or lower limits.max_sentence_tokens"):
            serving_app.create_app(translator, ServeLimits(), pool)
    app = serving_app.create_app(translator, ServeLimits(max_sentence_tokens=most), pool)
    with TestClient(app) as client:
        assert wait_for(lambda: client.get("/health").json()["status"] == "ok", timeout=60)
        assert client.get("/health").json()["scheduler"] == kind
        short = [t for t, n in zip(texts, lengths) if n <= most]
        answer = client.post("/v1/translate", json={"text": short})
        assert answer.status_code == 200, answer.text
        assert answer.json()["translations"] == translator.texts([h[0] for h in translator.translate_batch(translator.encode(short), translator.decode)])  # fmt: skip
        long = next(i for i, n in enumerate(lengths) if n > most)
        refused = client.post("/v1/translate", json={"text": texts})
    assert refused.status_code == 413, refused.text
    assert refused.json() == {
        "error": f"text[{long}] has {lengths[long]} tokens; at most {most}",
        "kind": "line_too_long",
    }
