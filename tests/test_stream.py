"""translate.py scheduler=continuous (decoding/stream.py): lines that arrive while others are being
decoded join the running batch and get translate_ids' translations, written in input order; an
error while reading reaches the caller; over a real pipe each translation comes out before the
next line goes in, and the output equals scheduler=batch'."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from transformer.decoding import DecodeConfig, Ensemble
from transformer.decoding.config import SchedulerConfig
from transformer.decoding.engine import Engine
from transformer.decoding.stream import translate_stream
from transformer.errors import DataError
from transformer.fast import accelerate
from transformer.runtime import RuntimeConfig
from transformer.translator import Translator

from .briefly_trained import multi30k_corpus, trained_model
from .servers import QUICK, ROOT, build_checkpoint, corpus_lines, translate_py


@pytest.fixture(scope="module")
def corpus():
    return multi30k_corpus()


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_lines_arriving_mid_batch_join_it_and_get_translate_ids_translations_in_order(corpus, strategy):
    model, tokenizer = trained_model(corpus, {}, steps=60)
    accelerate(model, RuntimeConfig())
    settings = DecodeConfig(strategy=strategy, beam_size=4, n_best=2 if strategy == "beam" else 1)
    translator = Translator(model, tokenizer, "cpu", settings)
    texts = corpus[0][:12]
    texts[3] = ""  # an empty line gets an empty translation, in its place
    expected = translator.translate_batch(translator.encode(texts), settings)
    engine = Engine(model, tokenizer, settings, "cpu", pool_bytes=1 << 20, block_size=4)

    index_of, running = {}, []  # each sentence's line; the lines running after each step
    add, step, released = engine.add, engine.step, threading.Event()

    def add_noting(sentence):
        index_of[id(sentence)] = len(index_of)
        add(sentence)

    def step_noting(join_tokens):
        ran = step(join_tokens)
        running.append({index_of[id(s)] for s in engine.running})
        if len(running) == 3:
            released.set()  # the second half of the input arrives after three steps
        return ran

    engine.add, engine.step = add_noting, step_noting

    def lines():
        yield from texts[:6]
        assert released.wait(60)
        yield from texts[6:]

    written = []
    count = translate_stream(
        engine, lines(), lambda text, i: translator.encode([text])[0], lambda i, hyps: written.append((i, hyps)),
        settings, tokenizer.eos_id,
    )  # fmt: skip
    assert count == len(texts)
    assert [i for i, _ in written] == list(range(len(texts)))
    got = [hyps for _, hyps in written]
    assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in expected]
    for hyps, ref in zip(got, expected):
        assert [h.score for h in hyps] == pytest.approx([h.score for h in ref], abs=1e-4)
    # Lines of the second half ran in the same steps as lines of the first: they joined mid-batch.
    nonempty_first = set(range(5))  # the engine numbers the 5 nonempty lines of the first half 0..4
    assert any(lines & nonempty_first and lines - nonempty_first for lines in running), running
    assert sorted(engine.pool.free) == list(range(engine.pool.n_blocks))


@pytest.mark.parametrize("kind", ["batch", "continuous"])
def test_the_translators_stream_writes_translate_batchs_translations_in_order(corpus, kind):
    """Translator.translate_stream over a generator, on the engine or in chunks (3 lines, so several
    of them): every line's n-best list in input order, as translate_batch gives it; an ensemble
    under scheduler=continuous falls back to chunks and says why."""
    model, tokenizer = trained_model(corpus, {}, steps=60)
    accelerate(model, RuntimeConfig())
    settings = DecodeConfig(strategy="beam", beam_size=3, n_best=2)
    translator = Translator(model, tokenizer, "cpu", settings)
    texts = corpus[0][:8]
    texts[2] = ""
    expected = translator.translate_batch(translator.encode(texts), settings)
    written = []
    schedule = SchedulerConfig(kind=kind, pool_mib=1, block_size=4)
    count = translator.translate_stream((t for t in texts), lambda i, n: written.append((i, n)), schedule, chunk_lines=3)  # fmt: skip
    assert count == len(texts) and [i for i, _ in written] == list(range(len(texts)))
    assert [[h.tokens for h in n] for _, n in written] == [[h.tokens for h in n] for n in expected]
    assert translator.fallback is None
    ensemble = Translator(Ensemble([model, model]), tokenizer, "cpu", settings)
    assert ensemble.translate_stream(iter(texts[:2]), lambda i, n: None, schedule) == 2
    assert (ensemble.fallback is not None) == (kind == "continuous")


def test_an_error_while_reading_reaches_the_caller(corpus):
    model, tokenizer = trained_model(corpus, {}, steps=60)
    settings = DecodeConfig(strategy="greedy")
    translator = Translator(model, tokenizer, "cpu", settings)
    engine = Engine(model, tokenizer, settings, "cpu", pool_bytes=1 << 20, block_size=4)

    def lines():
        yield from corpus[0][:2]
        raise DataError("input.de:3: line is not valid UTF-8")

    with pytest.raises(DataError, match="input.de:3"):
        translate_stream(
            engine, lines(), lambda text, i: translator.encode([text])[0], lambda i, hyps: None,
            settings, tokenizer.eos_id,
        )  # fmt: skip


@pytest.mark.e2e
def test_translate_py_continuous_answers_each_line_of_a_pipe_before_the_next_arrives(tmp_path):
    model_path = build_checkpoint(tmp_path / "model.pt")
    texts = corpus_lines("de", 6, "val")
    texts.insert(2, "")
    stdin = "".join(t + "\n" for t in texts)
    chunks = translate_py(f"checkpoint={model_path}", *QUICK, "decode.beam_size=3", stdin=stdin)
    assert chunks.returncode == 0, chunks.stderr

    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "translate.py", f"checkpoint={model_path}", *QUICK, "decode.beam_size=3", "scheduler=continuous"]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, env=environ, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    watchdog = threading.Timer(60, process.kill)  # an answer that never comes fails the test, not the run
    watchdog.start()
    try:
        got = []
        for text in texts:  # stdin stays open: each answer must come before the next line is sent
            process.stdin.write(text + "\n")
            process.stdin.flush()
            got.append(process.stdout.readline().rstrip("\n"))
        process.stdin.close()
        assert process.stdout.read() == "" and process.wait(60) == 0, process.stderr.read()
    finally:
        watchdog.cancel()
        process.kill()
    assert got == chunks.stdout.splitlines()

    # What the engine cannot run falls back to scheduler=batch with one warning, as in serve.py.
    prefixed = "Ein Hund läuft.\tA\n"
    fallback = translate_py(f"checkpoint={model_path}", "scheduler=continuous", "prefix=true", stdin=prefixed)
    batch = translate_py(f"checkpoint={model_path}", "prefix=true", stdin=prefixed)
    assert fallback.returncode == 0 and fallback.stdout == batch.stdout and fallback.stdout.startswith("A")
    assert "scheduler=continuous cannot run here (it translates plain lines, not prefix=): decoding with scheduler=batch" in fallback.stderr  # fmt: skip
    ensemble = translate_py(f"checkpoint={model_path}", f"ensemble=[{model_path}]", "scheduler=continuous", stdin="x\n")  # fmt: skip
    assert ensemble.returncode == 0 and "cannot run here (an ensemble" in ensemble.stderr
    small = translate_py(f"checkpoint={model_path}", "scheduler=continuous", "scheduler.pool_mib=0.001", stdin="x\n")
    assert small.returncode != 0 and "raise scheduler.pool_mib to" in small.stderr and "Traceback" not in small.stderr
