"""The benchmark scripts run end to end and report what they claim to (speeds are not asserted)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from .conftest import ROOT

# ours, its variants (each a model, loss, optimizer or environment of its own) and the peer torch
MEASURED = ["ours", "ours-blas", "ours-logits", "ours-foreach", "ours-spin-default", "torch"]


def load_benchmark(monkeypatch):
    spec = importlib.util.spec_from_file_location("benchmark_script", ROOT / "benchmarks" / "benchmark.py")
    benchmark = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, benchmark)  # its dataclasses look their module up there
    spec.loader.exec_module(benchmark)
    return benchmark


@pytest.mark.e2e
def test_training_benchmark_measures_ours_and_torch_on_the_same_batches_in_rounds(tmp_path):
    """The whole run: the batches built once, every measurement a process of its own in its own
    environment (ours, and the peer and ours-spin-default with OpenMP's default spin), rounds,
    the report. Every implementation's measurement itself: the test below, in this process."""
    out = tmp_path / "bench.json"
    args = [
        "presets=[tiny]",  # the test checks what is measured and reported, not the speed
        "implementations=[ours,ours-spin-default,torch]",
        "precisions=[fp32]",
        "threads=1",
        "steps=1",
        "rounds=2",
        "busy=1",
        "max_tokens=512",  # small batches, as the tiny model
        "peak_repeats=1",
        f"output={out}",
    ]
    result = subprocess.run(
        [sys.executable, "benchmarks/benchmark.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {r["implementation"]: r for r in report["rows"]}
    assert set(rows) == {"ours", "ours-spin-default", "torch"}
    assert rows["ours"]["parameters"] == rows["ours-spin-default"]["parameters"]
    assert (
        abs(rows["ours"]["parameters"] - rows["torch"]["parameters"]) / rows["torch"]["parameters"] < 0.01
    )  # same size
    assert all(r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0 and r["adam_ms"] > 0 for r in rows.values())
    assert all(len(r["tokens_per_s_runs"]) == 2 for r in rows.values())  # one measurement per round
    assert report["matmul_peak_gflops"]["fp32"] > 0 and "cpu_features" in report["hardware"]
    assert report["hardware"]["threads"] == 1 and report["hardware"]["busy_processes"] == 1
    assert "tiny fp32: ours over ours-spin-default" in result.stdout


def test_every_implementation_measures_a_training_step_of_the_same_model_size(monkeypatch, tmp_path):
    """What each measurement process of benchmarks/benchmark.py runs (measure_one), here for each
    implementation on the same batches: ours and its variants train one model, torch's is as large."""
    benchmark = load_benchmark(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for rows, src_len, tgt_len in ((8, 12, 10), (6, 9, 14), (10, 7, 8)):  # steps + 2: two warm-up steps, one timed
        src = torch.randint(4, benchmark.VOCAB, (rows, src_len), generator=generator)
        tgt = torch.randint(4, benchmark.VOCAB, (rows, tgt_len + 1), generator=generator)
        src[0, -3:], tgt[0, -3:] = 0, 0  # a padded sentence
        batches.append((src, tgt[:, :-1], tgt[:, 1:], int((src != 0).sum() + (tgt[:, 1:] != 0).sum())))
    torch.save(batches, tmp_path / "batches.pt")
    cfg = benchmark.BenchConfig(steps=1, batches=str(tmp_path / "batches.pt"))
    rows = {impl: benchmark.measure_one(cfg, impl, "tiny", "fp32") for impl in MEASURED}
    assert len({rows[name]["parameters"] for name in rows if name.startswith("ours")}) == 1
    assert (
        abs(rows["ours"]["parameters"] - rows["torch"]["parameters"]) / rows["torch"]["parameters"] < 0.01
    )  # same size
    assert all(r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0 and r["adam_ms"] > 0 for r in rows.values())


def test_only_ours_runs_with_the_packages_openmp_spin(monkeypatch):
    from transformer import openmp

    benchmark = load_benchmark(monkeypatch)
    monkeypatch.setattr(openmp, "applied", True)
    monkeypatch.setenv("GOMP_SPINCOUNT", openmp.SPIN_COUNT)
    assert benchmark.child_environment("ours")["GOMP_SPINCOUNT"] == openmp.SPIN_COUNT
    for impl in ("ours-spin-default", "torch", "hf-marian"):
        assert "GOMP_SPINCOUNT" not in benchmark.child_environment(impl)


@pytest.mark.e2e
def test_training_benchmark_refuses_compiling_without_the_cpp_compiler_before_measuring(tmp_path):
    env = {**os.environ, "CXX": "no-such-c++-compiler"}
    args = ["implementations=[ours-compile]", "presets=[small]", "precisions=[fp32]", "steps=1", "rounds=1"]
    args.append(f"batches={tmp_path / 'missing.pt'}")  # without the check, the measurement fails on this instead
    result = subprocess.run(
        [sys.executable, "benchmarks/benchmark.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: ours-compile needs a C++ compiler")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""  # nothing measured or printed before the refusal


@pytest.mark.e2e
def test_isa_avx2_reruns_the_script_with_its_libraries_kept_to_avx2(tmp_path):
    """benchmark*.py isa=avx2: the measuring process (and those it starts) run as on a CPU without
    AVX-512; ATen reports the capability it dispatches to."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys, torch\n"
        "from transformer.devices import isa_limit, limit_isa\n"
        "limit_isa('avx2', __file__, sys.argv[1:])\n"
        "print(isa_limit(), torch.backends.cpu.get_cpu_capability(), *sys.argv[1:])\n"
    )
    result = subprocess.run([sys.executable, str(script), "a=1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["avx2", "AVX2", "a=1"]


@pytest.mark.e2e
def test_ctranslate2_is_timed_in_a_process_of_its_own(tmp_path):
    """Part 3 of benchmark_decoding.py: CTranslate2 decodes the exported model in a child process,
    which reports the seconds of one timed batch and its translations; a failure there names its
    compute type."""
    import pytest

    pytest.importorskip("ctranslate2")
    from common import CTranslate2InChild  # benchmarks/common.py (pyproject.toml: pytest's pythonpath)
    from transformer.interop.export import export

    from .briefly_trained import multi30k_corpus, trained_model

    corpus = multi30k_corpus()
    model, tokenizer = trained_model(corpus, {}, steps=1)
    export(model, tokenizer, tmp_path / "ct2", "float32")
    pieces = [[tokenizer.source.id_to_piece(t) for t in s] for s in tokenizer.source.encode(corpus[0][:4])]
    options = dict(beam_size=1, max_decoding_length=5, min_decoding_length=5)
    seconds, hypotheses = CTranslate2InChild(str(tmp_path / "ct2"), "float32", 1, pieces, options)()
    assert seconds > 0 and len(hypotheses) == 4
    assert all(len(h) == 5 and all(tokenizer.id_to_piece(tokenizer.piece_to_id(p)) == p for p in h) for h in hypotheses)
    with pytest.raises(RuntimeError, match="CTranslate2 \\(float32\\) failed"):
        CTranslate2InChild(str(tmp_path / "missing"), "float32", 1, pieces, options)()


@pytest.mark.e2e
def test_a_ctranslate2_users_process_translates_a_file_as_our_pieces_decode(tmp_path):
    """compare_exported.py's whole CTranslate2 process (sentencepiece and ctranslate2, no torch)
    cuts the lines into the pieces our tokenizer gives and writes what CTranslate2 decodes from
    them, one line each."""
    pytest.importorskip("ctranslate2")
    from common import CTranslate2InChild
    from transformer.interop.export import TARGET_MODEL, export, source_model

    from .briefly_trained import multi30k_corpus, trained_model
    from .servers import load_entry

    script = load_entry("benchmarks/compare_exported.py")
    corpus = multi30k_corpus()
    model, tokenizer = trained_model(corpus, {}, steps=1)
    export(model, tokenizer, tmp_path / "ct2", "float32")
    lines = corpus[0][:4]
    (tmp_path / "in.txt").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    options = dict(beam_size=2, max_decoding_length=5, min_decoding_length=5)
    models = [str(tmp_path / "ct2" / name) for name in (source_model(tokenizer), TARGET_MODEL)]
    args = [str(tmp_path / "ct2"), "float32", "1", *models, str(tmp_path / "in.txt"), str(tmp_path / "out.txt")]
    subprocess.run([sys.executable, "-c", script.CT2_PROCESS, *args, json.dumps(options)], check=True)
    pieces = [[tokenizer.source.id_to_piece(t) for t in s] for s in tokenizer.source.encode(lines)]
    _, hypotheses = CTranslate2InChild(str(tmp_path / "ct2"), "float32", 1, pieces, options)()
    want = tokenizer.decode([[tokenizer.piece_to_id(p) for p in h] for h in hypotheses])
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines() == want


def test_compare_exported_runs_the_decoders_named_and_ours_fp32():
    from transformer.errors import ConfigError

    from .servers import load_entry

    script = load_entry("benchmarks/compare_exported.py")
    runs = {"ours fp32": 1, "ours int8 compiled": 2, "ctranslate2 float32": 3, "ctranslate2 int8": 4}
    assert script.chosen(runs, None) == runs
    assert script.chosen(runs, ["ctranslate2 int8", "ours int8 compiled"]) == {"ours fp32": 1, "ours int8 compiled": 2, "ctranslate2 int8": 4}  # fmt: skip
    with pytest.raises(
        ConfigError, match="no decoder named 'ours int8 shortlist'; with these settings they are ours fp32, "
    ):
        script.chosen(runs, ["ours int8 shortlist"])
