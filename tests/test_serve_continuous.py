"""serve.py's continuous scheduler over real HTTP (limits.scheduler=continuous): requests at random
moments into a small pool get translate.py's translations, a client that gives up costs no blocks;
and the rule both schedulers keep, that every piece of torch work runs on the one decoding thread."""

from __future__ import annotations

import asyncio
import random
import threading

import httpx
import pytest

from transformer.serving import ServeLimits
from transformer.serving import app as serving_app
from transformer.serving.metrics import Metrics
from transformer.translator import Translator

from .servers import QUICK, Server, build_checkpoint, corpus_lines, load_entry, translate_py, wait_for


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
        "limits.scheduler=continuous",
        "limits.pool_mib=0.25",
        "limits.block_size=16",
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
    assert health["pool"]["promised"] == 0 and health["scheduler"] == "continuous"


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

    for scheduler in ("request", "continuous"):
        _, batcher = serving_app.scheduler(translator, ServeLimits(scheduler=scheduler, pool_mib=1), Metrics())
        ident, decoding, failed = asyncio.run(threads(batcher))
        assert ident == decoding != threading.get_ident()
        assert isinstance(failed, ValueError)  # an error reaches its caller
    module = load_entry("serve.py")
    assert module.off_the_main_thread(threading.current_thread) is not threading.current_thread()
    assert not module.off_the_main_thread(threading.current_thread).is_alive()
