"""serve.py over real HTTP on 127.0.0.1, with a small checkpoint built here: it translates as
translate.py does, merges concurrent requests into batches and answers each in its order, refuses
every kind of bad request with a 4xx JSON error and goes on serving, drains on SIGTERM and exits 0,
answers a 5xx when its decoding thread breaks (and exits 1 when it cannot go on), and a bad config
is one error line."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from transformer.decoding import DecodeConfig, Hypothesis
from transformer.serving import Batcher, ServeLimits, create_app

from .servers import (
    QUICK,
    Server,
    break_the_decoding_thread,
    build_checkpoint,
    corpus_lines,
    loaded_translator,
    run_entry,
    translate_py,
    wait_for,
)

LIMITS = ["limits.max_lines=8", "limits.max_chars=200", "limits.max_wait_ms=50"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("serve") / "model.pt")


@pytest.fixture(scope="module")
def server(model_path):
    with Server(f"checkpoint={model_path}", *QUICK, *LIMITS) as running:
        yield running


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    return corpus_lines("de", 8, "val")


def post(server: Server, body, path: str = "/v1/translate") -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    return httpx.post(server.url + path, json=body, timeout=60)


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


@pytest.mark.e2e
def test_translations_and_n_best_lists_equal_translate_pys(server, model_path, sentences):
    text = [*sentences[:3], "", *sentences[3:7]]  # an empty line translates to an empty line
    expected = translate_py(f"checkpoint={model_path}", *QUICK, stdin="".join(s + "\n" for s in text))
    assert expected.returncode == 0, expected.stderr
    answer = post(server, {"text": text}).json()
    assert answer["translations"] == expected.stdout.splitlines()
    assert answer["timing"]["total_ms"] >= answer["timing"]["decode_ms"] > 0
    one = post(server, {"text": text[0]}).json()  # a single string: a list of one
    assert one["translations"] == expected.stdout.splitlines()[:1]

    n_best = translate_py(f"checkpoint={model_path}", *QUICK, "decode.beam_size=3", "decode.n_best=3", "decode.length_penalty=1.0", stdin=text[0] + "\n")  # fmt: skip
    answer = post(
        server, {"text": [text[0]], "beam_size": 3, "n_best": 3, "length_penalty": 1.0, "scores": True}
    ).json()
    rows = [line.split("\t") for line in n_best.stdout.splitlines()]
    assert [[h["translation"] for h in hyps] for hyps in answer["n_best"]] == [[row[2] for row in rows]]
    assert [f"{h['score']:.4f}" for h in answer["n_best"][0]] == [row[1] for row in rows]
    assert answer["scores"] == [answer["n_best"][0][0]["score"]]


async def translate_concurrently(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        responses = await asyncio.gather(*(client.post("/v1/translate", json=body) for body in bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


@pytest.fixture(scope="module")
def continuous_server(model_path):
    with Server(f"checkpoint={model_path}", *QUICK, *LIMITS, "scheduler=continuous") as running:
        yield running


@pytest.mark.e2e
def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server, continuous_server, sentences):
    """Both schedulers: continuous batching runs every request's sentences in shared steps, the
    request-level batcher merges requests with the same settings (never across two settings)."""
    for running in (continuous_server, server):
        alone = post(running, {"text": sentences}).json()["translations"]
        beam2 = post(running, {"text": sentences, "beam_size": 2}).json()["translations"]
        batches, translated = metric(running, "serve_batch_sentences_count"), metric(running, "serve_sentences_total")
        bodies = [{"text": s} for s in sentences] + [{"text": [s], "beam_size": 2} for s in sentences]
        answers = asyncio.run(translate_concurrently(running.url, bodies))
        assert [a["translations"][0] for a in answers] == alone + beam2  # in order, and settings kept apart
        assert metric(running, "serve_sentences_total") - translated == len(bodies)
        assert max(a["timing"]["batch_requests"] for a in answers) > 1
        if running is server:  # the default scheduler: request-level
            new_batches = metric(running, "serve_batch_sentences_count") - batches
            assert 2 <= new_batches < len(bodies)


BAD = [  # (what is sent, status, what the error names)
    (b'{"text": "Ein Hund', 400, "malformed JSON"),
    ('{"text": "Grüße"}'.encode("latin-1"), 400, "not valid UTF-8"),
    (b"", 400, "malformed JSON"),
    (["Ein Hund."], 422, "must be a JSON object"),
    ({}, 422, 'missing field "text"'),
    ({"text": 5}, 422, "text must be a string or a list of strings, not a number"),
    ({"text": ["Ein Hund.", None]}, 422, "text[1] must be a string, not null"),
    ({"text": "  "}, 422, "text is empty"),
    ({"text": []}, 422, "text is an empty list"),
    ({"text": "Ein\nHund"}, 422, "line break"),
    ({"text": "Hund", "beam": 4}, 422, "unknown field 'beam'"),
    ({"text": "Hund", "beam_size": 0}, 422, "beam_size=0 is not in [1, 8]"),
    ({"text": "Hund", "beam_size": "5"}, 422, "beam_size must be an integer, not a string"),
    ({"text": "Hund", "beam_size": 2, "n_best": 3}, 422, "n_best=3 is not in [1, 2]"),
    ({"text": "Hund", "length_penalty": -1}, 422, "length_penalty=-1 is not in [0, 5.0]"),
    ({"text": "Hund", "scores": "yes"}, 422, "scores must be true or false"),
    ({"text": "Hund " * 50}, 413, "text has 250 characters; at most 200"),
    ({"text": ["Hund"] * 9}, 413, "text has 9 lines; at most 8"),
    (b'{"text": "' + b"a" * 20000 + b'"}', 413, "the request body has"),
]


@pytest.mark.e2e
def test_every_bad_request_gets_its_4xx_json_error_and_the_server_goes_on(server, sentences):
    warnings = len([line for line in server.log if line.startswith("WARNING: 4")])
    for body, status, needle in BAD:
        response = post(server, body)
        assert response.status_code == status, (body, response.text)
        assert needle in response.json()["error"], (body, response.json())
        assert post(server, {"text": sentences[0]}).status_code == 200
    response = httpx.get(server.url + "/v1/translate")
    assert response.status_code == 405 and "error" in response.json()
    assert wait_for(lambda: len([line for line in server.log if line.startswith("WARNING: 4")]) == warnings + len(BAD) + 1)  # fmt: skip
    assert not any("Traceback" in line for line in server.log)
    assert metric(server, 'serve_errors_total{kind="malformed_json"}') >= 2


@pytest.mark.e2e
def test_health_metrics_and_the_page(server):
    assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, timeout=60), "never ready"
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model_loaded"] is True and "error" not in health
    assert health["device"] == "cpu" and health["language_pair"] == "de->en"
    assert health["limits"]["max_lines"] == 8
    text = httpx.get(server.url + "/metrics").text
    for name in ("serve_requests_total", "serve_sentences_total", "serve_batch_sentences_bucket",
                 "serve_request_latency_seconds_bucket", "serve_queue_requests"):  # fmt: skip
        assert name in text
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and 'id="translate"' in page.text
    assert httpx.get(server.url + "/static/app.js").status_code == 200


def test_health_is_503_until_the_model_has_decoded_a_sentence(model_path):
    translator, released = loaded_translator(model_path), threading.Event()
    decode = translator.translate_batch  # what the start-up check decodes with (the request scheduler's)
    translator.translate_batch = lambda sources, settings: released.wait(60) and decode(sources, settings)
    with TestClient(create_app(translator, ServeLimits())) as client:  # runs the app's startup here
        loading = client.get("/health")
        assert loading.status_code == 503 and loading.json()["status"] == "loading", loading.json()
        assert loading.json()["model_loaded"] is False
        released.set()
        assert wait_for(lambda: client.get("/health").status_code == 200, timeout=60)
        assert client.get("/health").json()["model_loaded"] is True


def test_health_is_503_with_the_error_when_the_model_cannot_decode(model_path):
    translator = loaded_translator(model_path)
    with torch.no_grad():
        translator.model.embed.embed.weight.fill_(math.nan)  # as a diverged training run leaves it
    with TestClient(create_app(translator, ServeLimits())) as client:
        assert wait_for(lambda: client.get("/health").json()["status"] != "loading", timeout=60)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "error", health.json()
        assert health.json()["model_loaded"] is False and "check sentence" in health.json()["error"]


@pytest.mark.e2e
def test_alignment_is_a_distribution_over_the_source_for_each_target_token(server, sentences):
    answer = post(server, {"text": sentences[1], "layer": 0}, "/v1/align").json()
    weights = answer["weights"]  # (target tokens, source tokens), both ending in </s>
    assert answer["layer"] == 0 and answer["source_tokens"][-1] == answer["target_tokens"][-1] == "</s>"
    assert len(weights) == len(answer["target_tokens"]) and {len(row) for row in weights} == {len(answer["source_tokens"])}  # fmt: skip
    assert all(abs(sum(row) - 1) < 1e-4 for row in weights)
    assert answer["translation"] == post(server, {"text": sentences[1]}).json()["translations"][0]
    given = post(server, {"text": sentences[1], "translation": "A dog runs."}, "/v1/align").json()
    assert given["translation"] == "A dog runs." and given["layer"] == 1  # the last layer by default
    refused = post(server, {"text": sentences[1], "layer": 2}, "/v1/align")
    assert refused.status_code == 422 and "layer=2 is not a decoder layer" in refused.json()["error"]


def stalled_request(server: Server) -> socket.socket:
    """A connection that has sent 13 bytes of a 40-byte request body, and waits."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b'Content-Length: 40\r\n\r\n{"text": "Ein')  # fmt: skip
    return sock


@pytest.mark.e2e
def test_a_slow_client_holds_up_no_one(server, sentences):
    """A client that sends half its body and stalls: the others are answered meanwhile."""
    with stalled_request(server) as slow:
        started = time.monotonic()
        assert post(server, {"text": sentences[:2]}).status_code == 200
        assert time.monotonic() - started < 30
        slow.sendall(b' Hund."}'.ljust(40 - len(b'{"text": "Ein'), b" "))
        assert b"200 OK" in slow.recv(4096)


def test_a_request_that_breaks_decoding_fails_alone_and_the_batch_around_it_is_answered():
    """The batcher, without a model: decoding echoes token ids, and raises on a poisoned sentence."""
    calls = []

    def decode(sources, settings):
        calls.append(len(sources))
        if [666] in sources:
            raise RuntimeError("poisoned")
        return [[Hypothesis(s, 0.0, 0.0)] for s in sources]

    async def main():
        batcher = Batcher(decode, max_batch_tokens=1000, max_wait_s=0.2, max_queue=10)
        batcher.start()
        requests = [[[1], [2]], [[666]], [[3]]]
        answers = await asyncio.gather(
            *(batcher.translate(r, DecodeConfig()) for r in requests), return_exceptions=True
        )
        batcher.close()
        return answers

    answers = asyncio.run(main())
    assert [[h[0].tokens for h in a.n_best] for a in (answers[0], answers[2])] == [[[1], [2]], [[3]]]
    assert isinstance(answers[1], RuntimeError)
    assert calls[0] == 4 and sorted(calls[1:]) == [1, 1, 2]  # one merged batch, then each request alone


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["batch", "continuous"])
def test_a_failing_decoding_thread_answers_5xx_serves_on_and_exits_1_when_it_cannot(model_path, sentences, kind):
    """serve.py whose decoding thread breaks outside decoding (tests/servers.py:
    break_the_decoding_thread): the request it held gets a JSON 500 naming the error, the traceback
    is logged once, and the server serves on with every block back; where the thread cannot
    recover, the request gets a JSON 503 and serve.py exits 1 naming the error. (The thread ended:
    every later request waited forever, and /health said ok.)"""
    with Server(f"checkpoint={model_path}", *QUICK, f"scheduler={kind}", inject=break_the_decoding_thread) as server:
        assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, timeout=60)
        expected = post(server, {"text": sentences[:3]}).json()["translations"]
        failed = post(server, {"text": sentences[:3], "length_penalty": 0.25})
        error = "decoding failed: RuntimeError: injected: the hook broke at length_penalty 0.25"
        assert failed.status_code == 500 and failed.json() == {"error": error, "kind": "decoding_failed"}, failed.text
        assert post(server, {"text": sentences[:3]}).json()["translations"] == expected
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "ok"
        if kind == "continuous":
            assert health["pool"]["free"] == health["pool"]["blocks"]
        assert wait_for(lambda: any("the requests in flight get a 500" in line for line in server.log))
        assert sum(line.startswith("Traceback") for line in server.log) == 1

        stopped = post(server, {"text": sentences[:1], "length_penalty": 0.75})
        assert stopped.status_code == 503 and stopped.json()["kind"] == "decoder_stopped", stopped.text
        assert stopped.json()["error"].startswith("the decoding thread stopped: RuntimeError: ")
        assert server.process.wait(60) == 1
    assert server.log[-1].strip().endswith(stopped.json()["error"])


def send_in_thread(url: str, body: dict) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(httpx.post(url + "/v1/translate", json=body, timeout=60)))
    thread.start()
    return thread, result


@pytest.mark.e2e
def test_a_full_queue_is_429_and_sigterm_drains_the_requests_in_flight(model_path, sentences):
    # The oldest request waits up to max_wait_ms in the queue for others: long here, so that it is
    # still there when the next request arrives and when SIGTERM comes.
    slow = Server(
        f"checkpoint={model_path}",
        *QUICK,
        "scheduler=batch",
        "limits.max_queue=1",
        "limits.max_wait_ms=3000",
        "drain_seconds=8",
    ).wait()
    try:
        first, result = send_in_thread(slow.url, {"text": sentences[0]})
        assert wait_for(lambda: metric(slow, "serve_queue_requests") == 1)
        full = post(slow, {"text": sentences[1]})
        assert full.status_code == 429 and "queue is full" in full.json()["error"]
        first.join(60)
        assert result[0].status_code == 200

        in_flight, result = send_in_thread(slow.url, {"text": sentences[:2]})
        assert wait_for(lambda: metric(slow, "serve_queue_requests") == 1)
        stalled = stalled_request(slow)  # would hold the shutdown forever without drain_seconds
        started = time.monotonic()
        assert slow.stop(timeout=60) == 0
        in_flight.join(60)
        assert result[0].status_code == 200 and len(result[0].json()["translations"]) == 2
        assert time.monotonic() - started < 40
        stalled.close()
    finally:
        slow.stop()


def free_port_in_use() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize(
    "case", ["missing checkpoint", "port in use", "bad limit", "bad port", "small pool", "bad scheduler"]
)
def test_a_bad_server_config_is_one_error_line(case, model_path, tmp_path, capsys):
    busy = free_port_in_use()
    args, needle = {
        "missing checkpoint": ([f"checkpoint={tmp_path / 'missing.pt'}"], "missing.pt does not exist"),
        "port in use": ([f"checkpoint={model_path}", f"port={busy.getsockname()[1]}"], f"port={busy.getsockname()[1]}"),
        "bad limit": ([f"checkpoint={model_path}", "limits.max_lines=0"], "limits.max_lines=0 must be >= 1"),
        "bad port": ([f"checkpoint={model_path}", "port=70000"], "port=70000 is not in 0..65535"),
        "small pool": (
            [f"checkpoint={model_path}", "scheduler=continuous", "scheduler.pool_mib=0.01"],
            "raise scheduler.pool_mib to",
        ),
        "bad scheduler": (
            [f"checkpoint={model_path}", "scheduler.kind=fifo"],
            "scheduler.kind='fifo' is not one of",
        ),
    }[case]
    with busy:
        status = run_entry("serve.py", args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert status != 0 and len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err


@pytest.mark.e2e
def test_load_test_reports_throughput_latency_and_the_servers_batch_size(server, sentences, tmp_path, capsys):
    (tmp_path / "in.de").write_text("".join(s + "\n" for s in sentences))
    args = [f"url={server.url}", f"input={tmp_path / 'in.de'}", "clients=4", "seconds=1.5", f"output={tmp_path / 'load.json'}"]  # fmt: skip
    assert run_entry("benchmarks/load_test.py", args) == 0
    results = json.loads((tmp_path / "load.json").read_text())
    assert results["sentences"] > 0 and results["errors"] == 0 and results["mean_batch_sentences"] >= 1
    latency = results["latency_ms"]
    assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"]
    assert "sentences/s" in capsys.readouterr().out


@pytest.mark.e2e
def test_load_test_checks_every_answer_against_the_expected_translations(
    server, model_path, sentences, tmp_path, capsys
):
    (tmp_path / "in.de").write_text("".join(s + "\n" for s in sentences))
    done = translate_py(f"checkpoint={model_path}", *QUICK, stdin=(tmp_path / "in.de").read_text())
    assert done.returncode == 0, done.stderr
    expected = done.stdout.splitlines()
    for name, lines, differ in (("right", expected, 0), ("wrong", ["?"] + expected[1:], None)):
        (tmp_path / name).write_text("".join(line + "\n" for line in lines))
        args = [f"url={server.url}", f"input={tmp_path / 'in.de'}", f"expected={tmp_path / name}", "clients=3", "seconds=1", f"output={tmp_path / 'load.json'}"]  # fmt: skip
        assert run_entry("benchmarks/load_test.py", args) == 0
        results = json.loads((tmp_path / "load.json").read_text())
        assert results["errors"] == 0 and results["sentences"] > len(sentences)
        if differ is not None:
            assert results["not_expected"] == differ
        else:
            assert results["not_expected"] > 0 and "expected ['?']" in results["first_not_expected"][0]
    assert "answers differ from expected=" in capsys.readouterr().out


@pytest.mark.e2e
def test_compare_schedulers_runs_both_and_reports_their_ratios(model_path, sentences, tmp_path, capsys):
    (tmp_path / "in.de").write_text("".join(s + "\n" for s in sentences))
    args = [f"checkpoint={model_path}", f"input={tmp_path / 'in.de'}", "clients=[2]", "seconds=1", "serve=[" + ",".join(f"'{q}'" for q in QUICK) + "]", f"output={tmp_path / 'out.json'}"]  # fmt: skip
    assert run_entry("benchmarks/compare_schedulers.py", args) == 0
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [(r["scheduler"], r["clients"]) for r in rows] == [("batch", 2), ("continuous", 2)]
    assert all(r["errors"] == 0 and r["throughput_sentences_per_s"] > 0 and r["peak_rss_mib"] > 0 for r in rows)
    assert "continuous / batch at 2 clients: throughput" in capsys.readouterr().out


@pytest.mark.e2e
def test_the_json_of_an_error_is_one_object(server):
    response = post(server, b"{")
    assert response.headers["content-type"].startswith("application/json")
    assert set(json.loads(response.text)) == {"error", "kind"}
