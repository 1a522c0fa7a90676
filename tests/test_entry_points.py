"""One way in: every command loads its model through transformer.translator.Translator and composes
its config with Hydra from configs/, so a precision, a runtime or a config group reaches each one."""

import importlib.util
import subprocess
import sys

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

import transformer.fast.int8
from transformer.fast.int8 import Int8Linear, Int8Plan, exact_weight_levels
from transformer.runtime import RuntimeConfig
from transformer.translator import Translator

from . import forked
from .conftest import ROOT
from .servers import QUICK, Server, build_checkpoint, corpus_lines, translate_py

pytestmark = pytest.mark.e2e  # builds a checkpoint and runs the commands


def command(name: str):
    """translate.py, evaluate.py or serve.py as a module, to call its main() in this process."""
    spec = importlib.util.spec_from_file_location(f"entry_{name}", ROOT / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("entry") / "model.pt")


@pytest.fixture
def loaded(monkeypatch) -> list[Translator]:
    """Every Translator that Translator.load returns in this test; int8 wherever it is exact, so
    that a layer of this tiny model is quantized even where int8 would be slower."""
    translators, load = [], Translator.load.__func__
    monkeypatch.setattr(Translator, "load", classmethod(lambda cls, *a, **k: translators.append(load(cls, *a, **k)) or translators[-1]))  # fmt: skip
    monkeypatch.setattr(transformer.fast.int8, "kernel_plan", lambda onednn, shape: Int8Plan(exact_weight_levels(), "test"))  # fmt: skip
    return translators


def int8_layers(translator: Translator) -> int:
    return sum(isinstance(module, Int8Linear) for module in translator.model.modules())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("name", ["translate", "evaluate", "serve"])
def test_every_command_decodes_with_every_precision(name, precision, model_path, loaded, tmp_path, monkeypatch):
    src, ref, out = tmp_path / "in.de", tmp_path / "ref.en", tmp_path / "out.en"
    src.write_text("\n".join(corpus_lines("de", 4, "val")) + "\n")
    ref.write_text("\n".join(corpus_lines("en", 4, "val")) + "\n")
    args = [f"checkpoint={model_path}", *QUICK, f"runtime.precision={precision}"]
    if name == "translate":
        command(name).main([*args, f"input={src}", f"output={out}"])
    elif name == "evaluate":
        command(name).main([*args, f"src={src}", f"ref={ref}", f"output={out}"])
    else:
        serve, apps = command(name), []
        monkeypatch.setattr(
            serve, "run", lambda app, sock, *rest: apps.append(app) or sock.close()
        )  # ran and stopped well
        serve.main([*args, "port=0"])
        with TestClient(apps[0]) as client:  # the app's start-up decode runs first
            response = client.post("/v1/translate", json={"text": src.read_text().splitlines()})
        assert response.status_code == 200, response.text
        out.write_text("\n".join(response.json()["translations"]) + "\n")
    [translator] = loaded
    assert translator.precision == precision
    assert (int8_layers(translator) > 0) == (precision == "int8")
    same = RuntimeConfig(precision=precision)
    expected = Translator.load(model_path, [], "cpu", translator.decode, same).translate(src.read_text().splitlines())
    assert out.read_text().splitlines() == expected


def test_translate_takes_a_decode_preset_from_configs(model_path, loaded, tmp_path):
    src = tmp_path / "in.de"
    src.write_text("\n".join(corpus_lines("de", 4, "val")) + "\n")
    outputs = {}
    for i, choice in enumerate(("decode=greedy", "decode.strategy=greedy", "decode=beam")):
        outputs[choice] = tmp_path / f"{i}.en"
        command("translate").main([f"checkpoint={model_path}", *QUICK, choice, f"input={src}", f"output={outputs[choice]}"])  # fmt: skip
    assert [t.decode.strategy for t in loaded] == ["greedy", "greedy", "beam"]
    assert outputs["decode=greedy"].read_text() == outputs["decode.strategy=greedy"].read_text()


def test_serve_with_int8_serves_the_int8_model_over_http(model_path):
    """...under both schedulers, with translate.py's int8 translations, and /health says so."""
    texts = corpus_lines("de", 3, "val")
    expected = translate_py(f"checkpoint={model_path}", *QUICK, "runtime.precision=int8", stdin="".join(t + "\n" for t in texts))  # fmt: skip
    assert expected.returncode == 0, expected.stderr
    for scheduler in ("continuous", "batch"):
        with Server(f"checkpoint={model_path}", *QUICK, "runtime.precision=int8", f"scheduler={scheduler}") as server:  # fmt: skip
            response = httpx.post(server.url + "/v1/translate", json={"text": texts}, timeout=60)
            health = httpx.get(server.url + "/health").json()
            log = "\n".join(server.log)
        assert response.status_code == 200
        assert response.json()["translations"] == expected.stdout.splitlines()
        assert (health["precision"], health["scheduler"]) == ("int8", scheduler)
        assert "runtime.precision=int8:" in log  # the quantizer's report of what it chose (fast/int8.py)
        assert f"runtime.precision=int8, scheduler={scheduler})" in log  # the serving line


def run(*args: str) -> subprocess.CompletedProcess:
    """`python *args`, its own process forked from a warm interpreter (tests/forked.py)."""
    return forked.run(list(args), timeout=300)


def error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return line


@pytest.mark.parametrize(
    "override, needle",
    [
        ("decode=nope", "Could not find 'decode/nope'; available: beam, greedy, sample"),
        ("runtime=nope", "Could not find 'runtime/nope'; available: fast, reference"),
        (
            "decode.beam_size=x",
            "Error merging override decode.beam_size=x (Value 'x' of type 'str' could not be converted to Integer)",
        ),  # fmt: skip
        ("decode.beam_size=0", "decode.beam_size=0 must be >= 1"),
        ("+decode.nope=1", "config key decode.nope: Key 'nope' not in 'DecodeConfig'"),
    ],
)
def test_train_and_the_other_commands_give_the_same_error_for_a_bad_setting(override, needle, model_path, tmp_path):
    errors = [
        error_line(run("train.py", "experiment=smoke", f"hydra.run.dir={tmp_path / 'run'}", override)),
        error_line(
            run(
                "distill.py",
                f"teacher={model_path}",
                "experiment=smoke",
                f"hydra.run.dir={tmp_path / 'distill'}",
                override,
            )
        ),  # fmt: skip
        *(
            error_line(run(f"{name}.py", f"checkpoint={model_path}", override))
            for name in ("translate", "evaluate", "serve")
        ),  # fmt: skip
    ]
    assert all(needle in error for error in errors), errors


def test_every_command_prints_its_config_groups_and_its_composed_config():
    for name in ("translate.py", "evaluate.py", "serve.py", "scripts/tune_decoding.py", "train.py", "distill.py"):
        help_text = run(name, "--help").stdout
        assert "decode: beam, greedy, sample" in help_text.replace("decode: beam, greedy, sample, null", "decode: beam, greedy, sample"), name  # fmt: skip
        assert "runtime: fast, reference" in help_text, name
        job = run(name, "--cfg", "job", "decode=greedy", "runtime=reference")
        assert job.returncode == 0, job.stderr
        assert "strategy: greedy" in job.stdout and "fast: false" in job.stdout, name


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="int8 needs oneDNN")
def test_training_decodes_its_test_splits_with_the_configured_precision(tmp_path, shared_corpus):
    result = run("train.py", "experiment=smoke", f"hydra.run.dir={tmp_path}", f"data.dir={shared_corpus}", "data.vocab_size=300", "runtime.precision=int8", "trainer.attention_images=false")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "runtime.precision=int8:" in (tmp_path / "train.log").read_text() + result.stderr
    assert len((tmp_path / "test_2016_flickr.beam5.en").read_text().splitlines()) == 40
