"""int8 decoding (runtime.precision=int8): each linear layer the start-up check finds exact and
faster in int8 becomes an Int8Linear (fast/int8.py), whose rows do not depend on each other, and a
briefly trained model predicts nearly as in fp32 through the real loading path."""

import concurrent.futures
import copy
import dataclasses
import os

import pytest
import torch
from torch import nn

import transformer.fast.int8
from transformer import checkpoint
from transformer.data.batching import pad
from transformer.decoding import DecodeConfig, translate_ids
from transformer.errors import ConfigError
from transformer.fast.int8 import (
    KERNELS,
    Int8Linear,
    describe,
    exact_weight_levels,
    kernel_plan,
    quantize_int8,
    quantize_rows,
)
from transformer.fast.int8_call import Int8Call, products_of
from transformer.runtime import RuntimeConfig
from transformer.translator import Translator

from .briefly_trained import multi30k_corpus, trained_model
from .conftest import make_model

pytestmark = pytest.mark.isa  # runs again under each instruction-set limit (tests/isa_matrix.py)


@pytest.fixture(params=list(KERNELS))
def int8_is_fast(request, monkeypatch, tmp_path):
    """For tests of what an all-int8 model computes, on each int8 kernel: the start-up check's
    timing, which decides per layer shape whether a loaded machine decodes in int8 at all and on
    which kernel, is taken as passed with this kernel the faster, so every layer is int8 on it (the
    real decision has its own tests below), with no timing kept from before. Returns the kernel."""
    if exact_weight_levels(request.param) is None:
        pytest.skip(f"int8 on {request.param} is not used here: no exact int8 product of it on this CPU")
    monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path))
    ratio = lambda levels, onednn, shape, kernel: 0.5 if kernel == request.param else 0.9  # noqa: E731
    monkeypatch.setattr(transformer.fast.int8, "int8_to_fp32_time", ratio)
    kernel_plan.cache_clear()
    yield request.param
    kernel_plan.cache_clear()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    corpus = multi30k_corpus()
    path = tmp_path_factory.mktemp("int8") / "model.pt"
    model, tokenizer = trained_model(corpus, {"tie_output": False})
    checkpoint.save(path, model, tokenizer, {}, step=0)
    return path, (corpus[0][:32], corpus[1][:32])


# Greedy translations of int8 and fp32 may part only where fp32 ranks the two tokens within this
# many nats: a near tie that int8's rounding tipped. Measured where they parted: on the test's 32
# sentences at most 0.043 natively (full-range weights), 0.062 under AVX2 and 0.053 under AVX512_CORE
# (weights in [-63, 63], no VNNI); in 675 partings (natively) and 924 (AVX2) over 1,300 training
# and validation sentences, at most 0.085 and 0.21. A channel of the output layer scaled 1.3x off
# parts translations at a gap of 0.95.
NEAR_TIE = 0.25
# Mean KL(fp32 || int8) per token, teacher-forced: measured 2e-4 natively, 5e-4 under AVX2 and 4e-4
# under AVX512_CORE (also over those 1,300 sentences); 3x the largest.
MEAN_KL = 1.5e-3


def parting_gap(model, source: list[int], ours: list[int], theirs: list[int], tokenizer) -> float:
    """Where the translations `ours` (model's greedy choice) and `theirs` first differ, EOS
    included: model's log-probability of its own token there minus that of theirs; 0 if they agree."""
    ours, theirs = ours + [tokenizer.eos_id], theirs + [tokenizer.eos_id]
    if ours == theirs:
        return 0.0
    t = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([source + [tokenizer.eos_id]]), torch.tensor([[tokenizer.bos_id] + ours[:t]]))
    log_probs = logits[0, -1].log_softmax(-1)
    return (log_probs[ours[t]] - log_probs[theirs[t]]).item()


def assert_int8_agrees_with_fp32(fp32, int8, tokenizer, de: list[str], en: list[str]) -> None:
    """Next-token choices (teacher-forced on the references) agree almost everywhere, and greedy
    translations part only at near ties of the fp32 model."""
    sources = tokenizer.source.encode(de)
    src = pad([s + [tokenizer.eos_id] for s in sources], tokenizer.pad_id)
    tgt = pad([[tokenizer.bos_id] + t for t in tokenizer.encode(en)], tokenizer.pad_id)
    with torch.no_grad():
        expected, got = fp32(src, tgt).log_softmax(-1), int8(src, tgt).log_softmax(-1)
    real = tgt != tokenizer.pad_id
    assert (expected.argmax(-1) == got.argmax(-1))[real].float().mean() >= 0.95
    assert (expected.exp() * (expected - got)).sum(-1)[real].mean() < MEAN_KL  # KL(fp32 || int8) per token
    cfg = DecodeConfig(strategy="greedy")
    ours = translate_ids(fp32, sources, tokenizer, cfg, "cpu")
    quantized = translate_ids(int8, sources, tokenizer, cfg, "cpu", precision="int8")
    gaps = [parting_gap(fp32, s, a[0].tokens, b[0].tokens, tokenizer) for s, a, b in zip(sources, ours, quantized)]
    assert max(gaps) <= NEAR_TIE, [f"sentence {i}: {gap:.3f}" for i, gap in enumerate(gaps) if gap > NEAR_TIE]


@pytest.mark.e2e
@pytest.mark.parametrize("fast", [True, False])
def test_int8_decoding_agrees_with_fp32(saved, fast, int8_is_fast):
    """With every linear layer in int8 on each kernel, through the real loading path: predictions
    agree with fp32 within int8's rounding (assert_int8_agrees_with_fp32)."""
    path, (de, en) = saved
    fp32, int8 = (Translator.load(path, [], "cpu", runtime=RuntimeConfig(fast=fast, precision=p)) for p in ("fp32", "int8"))  # fmt: skip
    assert not [m for m in int8.model.modules() if isinstance(m, nn.Linear)]  # every one quantized
    layers = [m for m in int8.model.modules() if isinstance(m, Int8Linear)]
    assert layers and {m.kernel for m in layers} == {int8_is_fast}
    assert_int8_agrees_with_fp32(fp32.model, int8.model, fp32.tokenizer, de, en)


@pytest.mark.e2e
@pytest.mark.parametrize("fast", [True, False])
def test_int8_loading_follows_the_start_up_check(saved, fast, caplog):
    """The start-up check as it decides on this CPU, whatever it decides: the log line says what
    was chosen for each layer shape, each linear layer is int8 exactly where the plan for its shape
    says so (the others stay fp32), and the model decodes as fp32 does within int8's rounding."""
    path, (de, en) = saved
    runtime = RuntimeConfig(fast=fast)
    with caplog.at_level("INFO", logger="transformer.fast.int8"):
        fp32, int8 = (Translator.load(path, [], "cpu", runtime=dataclasses.replace(runtime, precision=p)) for p in ("fp32", "int8"))  # fmt: skip
    linear = {name: m for name, m in fp32.model.named_modules() if isinstance(m, nn.Linear)}
    onednn = runtime.fast and runtime.onednn_inference  # as accelerate passes it to quantize_int8
    shapes = sorted({(m.in_features, m.out_features) for m in linear.values()})
    plans = {shape: kernel_plan(onednn, shape) for shape in shapes}  # this process's decisions, cached
    assert f"runtime.precision=int8: {describe(plans)}" in caplog.text
    layers = dict(int8.model.named_modules())
    for name, m in linear.items():
        plan = plans[m.in_features, m.out_features]
        assert type(layers[name]) is (type(m) if plan.weight_levels is None else Int8Linear), name
        assert plan.weight_levels is None or layers[name].kernel == plan.kernel, name
    assert_int8_agrees_with_fp32(fp32.model, int8.model, fp32.tokenizer, de, en)


@pytest.mark.e2e
def test_int8_is_refused_off_the_cpu(saved):
    with pytest.raises(ConfigError, match="runtime.precision=int8"):
        Translator.load(saved[0], [], "cuda", runtime=RuntimeConfig(precision="int8"))


def test_int8_is_a_precision_chosen_at_load_time():
    assert RuntimeConfig(precision="int8").precision == "int8"
    with pytest.raises(ValueError, match="runtime.precision"):
        RuntimeConfig(precision="int4")
    assert not hasattr(DecodeConfig(), "precision")  # not a per-call setting


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_int8_rows_are_independent_and_close_to_fp32(kernel):
    """Each row is quantized by its own scale: a row's output is the same alone or batched with a
    row 100 times larger (one scale per call, as torch's dynamic quantization has, fails this),
    and within int8's rounding of the fp32 product."""
    levels = exact_weight_levels(kernel)
    if levels is None:
        pytest.skip(f"int8 on {kernel} is not used here: no exact int8 product of it on this CPU")
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = Int8Linear(linear, levels, kernel=kernel)
    x = torch.randn(3, 64)
    with torch.no_grad():
        alone, expected = layer(x[:1]), linear(x[:1])
        batched = layer(torch.cat([x[:1], 100 * x[1:]]))[:1]
    assert torch.equal(alone, batched)
    assert (alone - expected).norm() <= 0.05 * expected.norm()


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_traced_int8_layer_calls_the_layer_of_the_running_model_by_name(kernel):
    """Int8Call, the form a compiled step traces, equals its Int8Linear where that layer is the
    running model's (products_of, in this thread), and names the layer where none is."""
    levels = exact_weight_levels(kernel)
    if levels is None:
        pytest.skip(f"int8 on {kernel} is not used here: no exact int8 product of it on this CPU")
    torch.manual_seed(0)
    layer = Int8Linear(nn.Linear(64, 48), levels, kernel=kernel)
    call, x = Int8Call(layer, "decoder_layers.0.w_q"), torch.randn(2, 3, 64)
    with torch.no_grad(), products_of({"decoder_layers.0.w_q": layer}):
        assert torch.equal(call(x), layer(x))
        other = concurrent.futures.ThreadPoolExecutor(1).submit(call, x)
        with pytest.raises(RuntimeError, match="'decoder_layers.0.w_q' outside the step of a model"):
            other.result()  # another thread runs no model's step
    with pytest.raises(RuntimeError, match="'decoder_layers.0.w_q' outside the step of a model"):
        call(x)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_int8_layers_compute_the_exact_integer_product_of_their_quantized_rows(kernel):
    """On each int8 kernel, at the instructions this CPU (or ISA limit) gives it, including inputs
    and weights at their extremes, where kernels that add u8 x s8 pairs in 16 bits saturate: the
    product equals the integer product of the quantized rows and weights, scaled."""
    levels = exact_weight_levels(kernel)
    if levels is None:
        pytest.skip(f"int8 on {kernel} is not used here: no exact int8 product of it on this CPU")
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=False)
    with torch.no_grad():
        linear.weight[:4] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]  # rows at the extremes
    x = torch.cat([torch.ones(2, 96), -torch.ones(2, 96), torch.randn(5, 96)])
    layer = Int8Linear(linear, levels, kernel=kernel)
    q_w, w_scale = quantize_rows(linear.weight.detach(), levels)
    q_x, x_scale = quantize_rows(x)
    expected = (q_x.double() @ q_w.double().t()) * x_scale.double() * w_scale.double().t()
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-6, atol=1e-6)


def test_the_start_up_check_narrows_the_weights_chooses_the_kernel_or_keeps_fp32(monkeypatch, caplog, tmp_path):
    """Where full-range int8 weights give inexact products on a kernel the weights are narrowed;
    where no range is exact on it, that kernel is not used, and with neither, int8 stays off; of
    the exact kernels the faster is used; a layer shape that is slower in int8 than in fp32 on both
    stays fp32, the others do not; the log says which and why."""
    int8 = transformer.fast.int8

    def plan_with(exact: dict[str, set[int]], ratio) -> None:
        """exact: the weight ranges exact on each kernel; ratio(shape, kernel): int8's time over fp32's."""
        monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path / str(len(list(tmp_path.iterdir())))))  # none kept
        monkeypatch.setattr(int8, "exact_products", lambda levels, kernel: levels in exact[kernel])
        monkeypatch.setattr(int8, "int8_to_fp32_time", lambda levels, onednn, shape, kernel: ratio(shape, kernel))
        int8.exact_weight_levels.cache_clear(), int8.kernel_plan.cache_clear()

    def both(levels: set[int]) -> dict[str, set[int]]:
        return {kernel: levels for kernel in KERNELS}

    try:
        plan_with(both({127, 63}), lambda shape, kernel: 0.5)
        assert (int8.kernel_plan().weight_levels, int8.kernel_plan().kernel) == (127, "onednn")  # a tie: oneDNN
        plan_with(both({63}), lambda shape, kernel: 0.5)
        assert int8.kernel_plan().weight_levels == int8.NARROW_WEIGHTS
        assert "saturates" in int8.describe({(8, 8): int8.kernel_plan(True, (8, 8))})
        plan_with(both(set()), lambda shape, kernel: 0.5)
        assert int8.kernel_plan().weight_levels is None
        plan_with({"onednn": {127}, "fbgemm": {63}}, lambda shape, kernel: 0.6 if kernel == "fbgemm" else 0.8)
        assert (int8.kernel_plan().weight_levels, int8.kernel_plan().kernel) == (63, "fbgemm")
        model = nn.Sequential(nn.Linear(8, 8))
        with caplog.at_level("INFO"):
            assert quantize_int8(model)[0].kernel == "fbgemm"
        assert "8x8 took FBGEMM 0.60x, oneDNN 0.80x fp32's time: FBGEMM" in caplog.text
        plan_with({"onednn": {127}, "fbgemm": set()}, lambda shape, kernel: 0.3 if kernel == "fbgemm" else 0.8)
        assert int8.kernel_plan().kernel == "onednn"
        assert "FBGEMM's int8 product is not exact on this CPU" in int8.kernel_plan().reason
        slower = lambda shape, kernel: 3.0 if shape == (8, 16) else 0.5  # noqa: E731 (the wider layer is slower in int8)
        plan_with(both({127}), slower)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 16))
        with caplog.at_level("INFO"):
            quantize_int8(model)
        assert [type(layer) for layer in model] == [Int8Linear, nn.Linear]
        assert "8x16 took oneDNN 3.00x, FBGEMM 3.00x fp32's time" in caplog.text
        assert "8x8 took oneDNN 0.50x" in caplog.text
        plan_with(both({127}), lambda shape, kernel: 3.0)
        model = nn.Sequential(nn.Linear(8, 8))
        with caplog.at_level("WARNING"):
            assert type(quantize_int8(model)[0]) is nn.Linear
        assert "decoding stays in fp32" in caplog.text
    finally:  # the next test finds this process's real decision
        int8.exact_weight_levels.cache_clear(), int8.kernel_plan.cache_clear()


@pytest.mark.parametrize("fast", [True, False])
def test_a_tied_output_projection_runs_in_int8_and_stays_tied(fast, int8_is_fast):
    """A model whose output projection is the embedding matrix keeps `output` None (what tying
    means to the rest of the code) and its output weight the embedding's, while the projection runs
    as an int8 copy: its logits are int8's rounding of the fp32 ones, not the fp32 ones."""
    torch.manual_seed(0)
    fp32 = make_model("fast" if fast else "reference", tie_output=True)
    int8 = quantize_int8(copy.deepcopy(fp32), fast)
    assert int8.output is None and int8.output_weight is int8.embed.embed.weight
    assert isinstance(int8.int8_output, Int8Linear) and int8.int8_output.kernel == int8_is_fast
    x = torch.randn(2, 3, fp32.cfg.d_model)
    with torch.no_grad():
        expected, got = fp32.project(x), int8.project(x)
    assert not torch.equal(got, expected)
    assert (got - expected).norm() <= 0.05 * expected.norm()


@pytest.mark.parametrize("fast", [True, False])
def test_an_int8_projection_cut_to_some_rows_gives_those_rows_logits(fast, int8_is_fast):
    """vocabulary_projection (a shortlist's) of an int8 tied projection: each row keeps its own
    weight scale and each input row its own, so the cut's logits are the whole projection's columns."""
    torch.manual_seed(0)
    int8 = quantize_int8(make_model("fast" if fast else "reference", tie_output=True), fast)
    assert isinstance(int8.int8_output, Int8Linear) and int8.int8_output.kernel == int8_is_fast
    ids = torch.tensor([3, 5, 8, 13, 21, 34])
    x = torch.randn(2, 3, int8.cfg.d_model)
    with torch.no_grad():
        torch.testing.assert_close(int8.vocabulary_projection(ids)(x), int8.project(x)[..., ids], rtol=1e-6, atol=1e-6)


def test_a_timing_is_taken_once_per_machine_and_kept(monkeypatch, tmp_path, caplog):
    """The speed check's timing of a layer shape is kept on disk: a later process (a busy machine,
    whose timing would say otherwise) makes the same choice; another shape, another instruction-set
    limit or a deleted file is timed again; a cache that cannot be written is a warning, not a failure."""
    int8 = transformer.fast.int8
    timed = [kernel for kernel in KERNELS if int8.exact_weight_levels(kernel) is not None]  # each is timed
    if not timed:
        pytest.skip("int8 is not used here: no exact int8 product on this CPU, so nothing is timed")
    calls = []

    def timing(ratio: float):
        monkeypatch.setattr(int8, "int8_to_fp32_time", lambda levels, onednn, shape, kernel: calls.append(shape) or ratio)  # fmt: skip
        int8.kernel_plan.cache_clear()  # as a new process

    monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path / "cache"))
    try:
        timing(0.5)
        first = int8.kernel_plan(True, (8, 8))
        assert first.weight_levels is not None and first.timing == "timed now"
        timing(3.0)  # a busy machine
        again = int8.kernel_plan(True, (8, 8))
        assert (again.weight_levels, again.reason) == (first.weight_levels, first.reason)
        assert calls == [(8, 8)] * len(timed)
        assert again.timing.startswith("timed on ") and str(tmp_path / "cache") in int8.describe({(8, 8): again})
        assert int8.kernel_plan(True, (8, 16)).weight_levels is None and calls == [(8, 8)] * len(timed) + [(8, 16)] * len(timed)  # fmt: skip
        with monkeypatch.context() as other:  # the key names the limit: another one is timed again
            other.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "AVX512" if os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS") == "AVX2" else "AVX2")  # fmt: skip
            assert int8.kernel_plan.__wrapped__(True, (8, 8)).weight_levels is None and len(calls) == 3 * len(timed)
        (tmp_path / "cache" / "int8_timings.json").unlink()
        int8.kernel_plan.cache_clear()
        assert int8.kernel_plan(True, (8, 8)).weight_levels is None and len(calls) == 4 * len(timed)
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("TRANSFORMER_CACHE_DIR", str(tmp_path / "file"))  # not a directory
        timing(0.5)
        with caplog.at_level("WARNING"):
            assert int8.kernel_plan(True, (8, 8)).weight_levels is not None
        assert "int8 timings not kept" in caplog.text
    finally:
        int8.kernel_plan.cache_clear()
