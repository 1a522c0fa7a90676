"""The compiled decoding step (transformer/fast/compiled.py) against the eager step it replaces:
the same decoder outputs step by step, the same translations in greedy and beam search (beams
reordered and sentences dropped between compiled steps), a kept program found by a new model, int8
layers called by the program on each kernel, and without a C++ compiler the eager step, said in
the log."""

import inspect
import logging
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from transformer.decoding import DecodeConfig, beam_search, greedy
from transformer.fast import accelerate, compiled, int8, int8_call
from transformer.model import attention_variants, padding_mask
from transformer.runtime import RuntimeConfig

from .conftest import BOS, EOS, PAD, make_model, random_tokens

pytestmark = pytest.mark.isa  # runs again under each instruction-set limit (tests/isa_matrix.py)


def compiling(test):
    """A test that compiles programs (about 20 s each, with the C++ compiler): end to end (e2e)."""
    test = pytest.mark.e2e(test)
    return pytest.mark.skipif(shutil.which("g++") is None, reason="compiling needs a C++ compiler")(test)


TEACHER_LIKE = {"positional": "rope", "norm": "rmsnorm", "activation": "swiglu", "norm_first": True, "n_kv_heads": 2}


@pytest.fixture(autouse=True)
def fresh_log():
    compiled.log_once.cache_clear()  # each test reads the lines it logs


def fast_model(setting, int8=False, **overrides):
    """A tiny fast model with runtime.compiled_step=setting (int8: runtime.precision=int8). Its
    products stay on BLAS: by default the first products of each shape alternate between BLAS and
    oneDNN (fast/linear.py: by_rows), whose roundings differ, so two runs of one model could part
    at a near tie of the random weights."""
    runtime = RuntimeConfig(onednn_linear=False, compiled_step=setting)
    return accelerate(make_model("reference", **overrides), runtime, int8=int8)


def count_compiled(monkeypatch) -> list[int]:
    """Calls of the compiled step, by rows, recorded as they run."""
    rows, run = [], compiled.CompiledStep.__call__

    def spy(self, model, tgt, src_mask, state):
        rows.append(tgt.size(0))
        return run(self, model, tgt, src_mask, state)

    monkeypatch.setattr(compiled.CompiledStep, "__call__", spy)
    return rows


def search(model, src):
    cfg = DecodeConfig(beam_size=3, max_len_a=1.0, max_len_b=6)
    with torch.no_grad():
        return greedy(model, src, BOS, EOS, cfg), beam_search(model, src, BOS, EOS, cfg)


def assert_steps_equal(eager, model, src, tgt):
    """Step by step, teacher forced on `tgt`: `model`'s decoder output equals `eager`'s at every step."""
    with torch.no_grad():
        mask = padding_mask(src, PAD)
        memory = eager.encode(src, mask)[0]
        states = eager.new_state(), model.new_state()
        for i in range(tgt.size(1)):
            want = eager.decode(tgt[:, i : i + 1], memory, mask, states[0], project=False)[0]
            got = model.decode(tgt[:, i : i + 1], memory, mask, states[1], project=False)[0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def products_on(monkeypatch, library: str) -> None:
    """Programs compiled from now on run their fp32 products on `library` ("blas" or "onednn"),
    whatever this CPU's vendor."""
    monkeypatch.setattr(compiled, "products", lambda: (library, "chosen by the test"))


def program_source(cache: Path) -> str:
    """The C++ of the programs kept under `cache`, as AOTInductor wrote it into each package."""
    sources = []
    for package in (cache / "compiled").glob("step-*.pt2"):
        with zipfile.ZipFile(package) as archive:
            sources += [archive.read(n).decode() for n in archive.namelist() if n.endswith(".wrapper.cpp")]
    assert sources, "a kept program with its C++"
    return "\n".join(sources)


@compiling
@pytest.mark.parametrize(
    "variant, library",
    [({}, "blas"), (TEACHER_LIKE, "onednn")],  # each model and each library (two programs each)
    ids=["post-norm-blas", "rope-swiglu-gqa-onednn"],
)
def test_compiled_steps_equal_the_eager_steps(variant, library, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    products_on(monkeypatch, library)
    src = random_tokens(5, 9)
    src[3:, 6:] = PAD
    tgt = random_tokens(5, 7)
    eager, model = fast_model(False, **variant), fast_model(True, **variant)
    assert_steps_equal(eager, model, src, tgt)
    assert model.compiled_step.programs[1] is not None
    # The program's fp32 products: oneDNN's with the weights packed inside it, or torch's BLAS.
    assert ("_linear_pointwise" in program_source(tmp_path)) == (library == "onednn")

    rows = count_compiled(monkeypatch)
    (greedy_eager, beams_eager), (greedy_compiled, beams_compiled) = search(eager, src), search(model, src)
    assert 5 in rows and 15 in rows, "greedy steps (5 rows) and beam steps (5 x 3 rows) ran compiled"
    assert greedy_compiled == greedy_eager
    for got, want in zip(beams_compiled, beams_eager):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-5)

    # A new model with the same weights finds the kept programs without compiling (the default, null).
    monkeypatch.setattr(compiled, "compile_step", lambda *args: pytest.fail("compiled again"))
    compiled.log_once.cache_clear()
    rows.clear()
    with caplog.at_level(logging.INFO, logger="transformer.fast.compiled"):
        assert search(fast_model(None, **variant), src)[0] == greedy_eager
    assert "steps after the first run" in caplog.text and 15 in rows
    assert "fp32 products" in caplog.text and "chosen by the test" in caplog.text


@compiling
def test_a_model_whose_weights_change_decodes_with_its_new_weights(tmp_path, monkeypatch, caplog):
    """A program holds the weights it was compiled with. After an optimizer step (fused Adam,
    which leaves version counters as they were) and after a checkpoint is loaded, the model's next
    steps are those of its new weights, step by step as the eager model's: it asks for the program
    of the new weights (here the compiler fails, so the eager step runs; compiling costs 20 s)."""
    monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    products_on(monkeypatch, "blas")
    src, tgt = random_tokens(4, 8), random_tokens(4, 6)
    eager, model = fast_model(False), fast_model(True)
    assert_steps_equal(eager, model, src, tgt)  # compiled for the first weights
    first = model.compiled_step.programs[1]
    assert first is not None
    asked = []

    def compile_step(model, width, path, *args):
        asked.append(path)
        raise RuntimeError("not compiled in this test")

    monkeypatch.setattr(compiled, "compile_step", compile_step)

    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    model(src, tgt).logsumexp(-1).mean().backward()
    optimizer.step()
    eager.load_state_dict(model.state_dict())
    with caplog.at_level(logging.INFO, logger="transformer.fast.compiled"):
        assert_steps_equal(eager, model, src, tgt)
    assert "weights changed" in caplog.text and len(asked) == 1

    other = fast_model(False)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.load_state_dict(other.state_dict())
    assert_steps_equal(other, model, src, tgt)
    assert len(set(asked)) == 2, "a program of their own asked for each new weights"

    model.load_state_dict(fast_model(False).state_dict())  # the first weights again: their kept program
    rows = count_compiled(monkeypatch)
    assert_steps_equal(fast_model(False), model, src, tgt)
    assert rows and len(asked) == 2


def test_the_program_key_covers_every_file_the_trace_runs_through():
    """Every class of a traced model, and every module its classes' code comes from, is in the
    code a program's key digests (fast/attention.py among them)."""
    model = fast_model(True, **TEACHER_LIKE)
    traced = compiled.traced_model(model, type(model.decoder_layers[0]))
    classes = {cls for m in traced.modules() for cls in type(m).__mro__ if cls.__module__.startswith("transformer.")}
    files = {Path(inspect.getsourcefile(cls)).resolve() for cls in classes}
    sources = {p.resolve() for p in compiled.traced_sources()}
    assert files <= sources and Path(compiled.__file__).resolve() in sources
    assert Path(inspect.getsourcefile(compiled.FastMultiHeadAttention)).resolve() in sources


@compiling
def test_compiled_int8_steps_equal_the_eager_int8_steps(tmp_path, monkeypatch):
    """int8 with the compiled step: the program calls the decoder's int8 layers on their kernels
    (int8_call.Int8Call; layers of different shapes on different kernels where this torch has
    several) and equals the same quantized model decoding eagerly, step by step and in greedy and
    beam search. Its fp32 products on oneDNN: the program is frozen, int8 calls included."""
    monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    products_on(monkeypatch, "onednn")
    kernels = [k for k in int8.KERNELS if int8.kernel_available(k)]
    shapes = []

    def kernel_plan(onednn, shape):  # each new shape on the next kernel
        if shape not in shapes:
            shapes.append(shape)
        kernel = kernels[shapes.index(shape) % len(kernels)]
        return int8.Int8Plan(int8.exact_weight_levels(kernel), "test", kernel=kernel)

    monkeypatch.setattr(int8, "kernel_plan", kernel_plan)
    src = random_tokens(5, 9)
    src[3:, 6:] = PAD
    tgt = random_tokens(5, 7)
    eager, model = fast_model(False, int8=True, **TEACHER_LIKE), fast_model(True, int8=True, **TEACHER_LIKE)
    layers = int8_call.int8_layers(model.decoder_layers)
    assert {layer.kernel for layer in layers.values()} == set(kernels)
    assert_steps_equal(eager, model, src, tgt)
    assert model.compiled_step.programs[1] is not None
    rows = count_compiled(monkeypatch)
    (greedy_eager, beams_eager), (greedy_compiled, beams_compiled) = search(eager, src), search(model, src)
    assert 5 in rows and 15 in rows and greedy_compiled == greedy_eager
    assert [[h.tokens for h in b] for b in beams_compiled] == [[h.tokens for h in b] for b in beams_eager]


def test_fp32_products_are_packed_for_onednn_where_mkl_runs_generic_kernels(monkeypatch):
    """The rule the log states: packed for oneDNN on AMD CPUs (MKL runs its generic kernels
    there); on torch's BLAS, as traced, on Intel CPUs and where the vendor cannot be read."""
    for vendor, library in [("GenuineIntel", "blas"), ("AuthenticAMD", "onednn"), ("unknown", "blas")]:
        monkeypatch.setattr(compiled, "cpu_info", lambda field, default, vendor=vendor: vendor if field == "vendor_id" else default)  # fmt: skip
        assert compiled.products()[0] == library


def test_without_a_compiler_the_eager_step_runs_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    src = random_tokens(4, 8)
    rows = count_compiled(monkeypatch)
    with caplog.at_level(logging.INFO, logger="transformer.fast.compiled"):
        got = search(fast_model(True), src)
    assert rows == [] and "no C++ compiler" in caplog.text
    assert got == search(fast_model(False), src)
    assert not (tmp_path / "compiled").exists() or not any((tmp_path / "compiled").iterdir())


def test_steps_it_does_not_take_run_eagerly(tmp_path, monkeypatch, caplog):
    """No program for models it cannot trace (attention variants, int8), nothing compiled by
    default (null), and a kept program looked up only where one is kept."""
    monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path))
    rows = count_compiled(monkeypatch)
    src = random_tokens(3, 6)
    moh = {"attention": attention_variants.AttentionConfig(kind="moh", shared_heads=1, top_k=2)}
    with caplog.at_level(logging.INFO, logger="transformer.fast.compiled"):
        search(fast_model(True, **moh), src)
        search(fast_model(None), src)
    assert rows == []
    assert "attention variants (FastMoHAttention)" in caplog.text
    assert "none kept on this machine" in caplog.text
    assert RuntimeConfig().compiled_step is None


@pytest.mark.parametrize("setting", [None, True])
def test_a_broken_kept_program_is_named_once_then_compiled_again_or_left(setting, tmp_path, monkeypatch, caplog):
    """A kept program that cannot be loaded (a torn write, another torch's) gets one warning line
    naming its file; runtime.compiled_step=true then compiles it again, null decodes eagerly."""
    monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    broken = tmp_path / "compiled" / "step-kept.pt2"
    broken.parent.mkdir()
    broken.write_bytes(b"not a program")
    monkeypatch.setattr(compiled, "program_path", lambda *args: broken)
    compiles = []

    def compile_step(model, width, path, *args):  # a compiler that fails: the eager step remains
        compiles.append(path)
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(compiled, "compile_step", compile_step)
    src, cfg = random_tokens(3, 6), DecodeConfig(max_len_a=1.0, max_len_b=6)
    with caplog.at_level(logging.INFO, logger="transformer.fast.compiled"), torch.no_grad():
        got = greedy(fast_model(setting), src, BOS, EOS, cfg)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "could not be loaded" in w and str(broken) in w]) == 1, warnings
    assert compiles == ([broken] if setting else [])
    with torch.no_grad():
        assert got == greedy(fast_model(False), src, BOS, EOS, cfg)
