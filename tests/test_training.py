"""The schedule, the loss against torch's reference, and a tiny model that overfits a tiny corpus."""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from transformer.config import Config, ConfigError
from transformer.data import DataConfig
from transformer.data.batching import collate, tokenize
from transformer.data.tokenizer import Tokenizer
from transformer.decoding import DecodeConfig, translate_corpus
from transformer.devices import autocast_dtype, cpu_has_bf16_matmul, require_cpp_compiler
from transformer.fast import accelerate
from transformer.model import ModelConfig, Transformer
from transformer.runtime import RuntimeConfig
from transformer.training import Trainer, run
from transformer.training.config import TrainerConfig
from transformer.training.objective import label_smoothed_loss, smoothed_cross_entropy, symmetric_kl
from transformer.training.optimizer import adam, trainer_adam
from transformer.training.schedule import inverse_sqrt_lr, scheduled_lr, warmup_ramp

from . import forked


def test_schedule_is_the_papers_formula():
    d_model, warmup = 512, 4000
    peak = d_model**-0.5 * warmup**-0.5
    for step in (1, 100, 3999, 4000, 4001, 20000, 100000):
        paper = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert inverse_sqrt_lr(step, peak, warmup) == pytest.approx(paper)
    assert max(range(1, 10000), key=lambda s: inverse_sqrt_lr(s, 1.0, warmup)) == warmup


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_budget_schedules_warm_up_like_the_paper_then_reach_zero_at_the_end(schedule):
    peak, warmup, warmup_progress = 1e-3, 500, 0.2

    def lr(step, progress):
        return scheduled_lr(schedule, step, peak, warmup, progress, warmup_progress)

    for step in (1, 250, 499):
        assert lr(step, step / 2500) == pytest.approx(inverse_sqrt_lr(step, peak, warmup))
    assert lr(warmup, warmup_progress) == pytest.approx(peak)
    assert lr(2000, 0.6) == pytest.approx(peak / 2)  # both are at half the peak halfway through the decay
    assert lr(2500, 1.0) == pytest.approx(0.0, abs=1e-15)
    decay = [lr(600 + i, p) for i, p in enumerate(torch.linspace(0.2, 1.0, 50).tolist())]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_the_inverse_sqrt_schedule_ignores_the_budget_unless_it_cools_down():
    assert scheduled_lr("inverse_sqrt", 2000, 1e-3, 500, 0.9, 0.1) == inverse_sqrt_lr(2000, 1e-3, 500)
    paper = inverse_sqrt_lr(2000, 1e-3, 500)
    for progress, fraction in ((0.5, 1.0), (0.8, 1.0), (0.9, 0.5), (0.95, 0.25), (1.0, 0.0)):
        cooled = scheduled_lr("inverse_sqrt", 2000, 1e-3, 500, progress, 0.1, cooldown=0.2)
        assert cooled == pytest.approx(fraction * paper, abs=1e-15)


def test_a_fraction_of_the_budget_ends_warmup_on_a_machine_that_takes_few_steps():
    # 500 warmup steps, or 10% of the budget: a machine that takes 800 steps in its budget (1% each)
    # ends warmup at step 80 instead of step 500; one that takes 10,000 steps ends it at step 500.
    assert warmup_ramp(40, 500, 40 / 800, 0.1) == pytest.approx(0.5)
    assert warmup_ramp(80, 500, 80 / 800, 0.1) == 1.0
    assert warmup_ramp(250, 500, 250 / 10_000, 0.1) == pytest.approx(0.5)
    assert warmup_ramp(250, 500, 0.5, 0.0) == pytest.approx(0.5)  # 0: steps alone
    # As the trainer calls it: the budget used before each step; from step 81 on, warmup ended there.
    slow = [scheduled_lr("linear", s, 1e-3, 81 if s >= 81 else 500, (s - 1) / 800, 0.1, ramp=warmup_ramp(s, 500, (s - 1) / 800, 0.1)) for s in range(1, 801)]  # fmt: skip
    assert max(slow) == pytest.approx(1e-3) and slow.index(max(slow)) == 80  # the peak at step 81
    assert all(a <= b for a, b in zip(slow[:80], slow[1:81])) and all(a >= b for a, b in zip(slow[80:], slow[81:]))
    assert slow[-1] == pytest.approx(1e-3 / 720, rel=0.01)  # annealed: one step of the decay left


@pytest.mark.e2e
def test_a_token_budget_stops_the_run_and_fits_the_schedule(tmp_path, shared_corpus):
    run_dir = tmp_path / "run"
    budget = ["trainer.max_tokens_seen=12000", "trainer.schedule=linear", "trainer.warmup_steps=1000", "trainer.warmup_fraction=0.25"]  # fmt: skip
    done = forked.run(
        ["train.py", "experiment=smoke", f"data.dir={shared_corpus}", "data.max_tokens=256",
         "trainer.max_steps=1000", "trainer.log_every=1", "trainer.eval_every=1000", "trainer.eval_bleu=false",
         "data.test_splits=[]", "trainer.precision=fp32", *budget, f"hydra.run.dir={run_dir}"],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if "lr" in r]
    state = torch.load(run_dir / "checkpoint_last.pt", weights_only=False)["train_state"]
    assert 10 < len(lrs) == state["step"] < 1000  # the tokens ran out first
    assert state["train_tokens"] >= 12000 > state["train_tokens"] - 2 * 256  # at the step that reached the budget
    peak = lrs.index(max(lrs)) + 1
    assert 0.15 < peak / len(lrs) < 0.35  # warmup ended at a quarter of the budget, not after 1000 steps
    assert all(a <= b for a, b in zip(lrs[:peak], lrs[1:peak])) and all(a >= b for a, b in zip(lrs[peak - 1 :], lrs[peak:]))  # fmt: skip
    assert lrs[-1] < max(lrs) / 5  # then decayed towards 0 by the end of the budget


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_label_smoothed_loss_matches_torch_cross_entropy(smoothing):
    torch.manual_seed(0)
    logits, target = torch.randn(3, 5, 11), torch.randint(1, 11, (3, 5))
    target[0, 3:] = 0  # padding
    loss, nll = label_smoothed_loss(logits, target, pad_id=0, smoothing=smoothing)
    flat = logits.view(-1, 11), target.view(-1)
    expected = F.cross_entropy(*flat, ignore_index=0, label_smoothing=smoothing, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, F.cross_entropy(*flat, ignore_index=0, reduction="sum"))


@pytest.mark.e2e
@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
def test_tiny_model_overfits_a_tiny_corpus(tiny_corpus, fast):
    """Memorizing 12 real sentence pairs: loss near zero and greedy decoding reproduces them,
    with the reference model and with the fast paths installed."""
    from transformer.data import DataConfig, load_split

    torch.manual_seed(0)
    ds = load_split(DataConfig(dir=str(tiny_corpus)), "train").select(range(12))
    tokenizer = Tokenizer.train(list(ds["src"]) + list(ds["tgt"]), vocab_size=120, model_type="unigram")
    corpus = tokenize(ds, tokenizer)
    model = Transformer(
        ModelConfig(
            vocab_size=len(tokenizer),
            n_encoder_layers=1,
            n_decoder_layers=1,
            d_model=64,
            n_heads=4,
            d_ff=128,
            dropout=0.0,
        )
    )
    model = accelerate(model, RuntimeConfig(fast=fast))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = collate(corpus, list(range(len(corpus))), tokenizer)
    for _ in range(300):
        loss, _ = label_smoothed_loss(model(batch.src, batch.tgt_in), batch.tgt_out, tokenizer.pad_id, 0.0)
        optimizer.zero_grad()
        (loss / batch.n_tgt_tokens).backward()
        optimizer.step()
    assert float(loss.detach()) / batch.n_tgt_tokens < 0.05
    assert math.isfinite(float(loss.detach()))
    hyps = translate_corpus(model, corpus, tokenizer, DecodeConfig(), torch.device("cpu"))
    assert hyps == corpus.tgt_text


@pytest.mark.e2e
@pytest.mark.parametrize(
    "variant",
    [
        {"attention": {"kind": "moh", "shared_heads": 1, "top_k": 2}},
        {"attention": {"kind": "dcmha", "rank": 2}},
        {"attention": {"kind": "overlap", "overlap": 4}},
        {"positional": "rope", "norm": "rmsnorm", "activation": "swiglu", "norm_first": True},
    ],
    ids=["moh", "dcmha", "overlap", "modern"],
)
def test_every_attention_variant_learns_a_tiny_corpus(tiny_corpus, variant):
    """Each variant trains (with MoH's balance loss in the objective) and memorizes 12 pairs: its
    loss per token falls below 0.05 within 400 steps (each variant took 46-64 steps to pass 0.1 on
    an AVX-512 Xeon, and every kernel path is below 0.002 by step 400; MoH's routing can spike the
    loss for a few steps later on, 0.10 at step 250 on one thread under AVX2)."""
    from transformer.data import DataConfig, load_split

    torch.manual_seed(0)
    ds = load_split(DataConfig(dir=str(tiny_corpus)), "train").select(range(12))
    tokenizer = Tokenizer.train(list(ds["src"]) + list(ds["tgt"]), vocab_size=120, model_type="unigram")
    corpus = tokenize(ds, tokenizer)
    cfg = dict(vocab_size=len(tokenizer), n_encoder_layers=1, n_decoder_layers=1, d_model=64, n_heads=4, d_ff=128)
    model = Transformer(ModelConfig(**cfg, dropout=0.0, **variant))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = collate(corpus, list(range(len(corpus))), tokenizer)
    losses = []
    while len(losses) < 400 and (not losses or losses[-1] >= 0.05):
        loss, _ = label_smoothed_loss(model(batch.src, batch.tgt_in), batch.tgt_out, tokenizer.pad_id, 0.0)
        objective = loss / batch.n_tgt_tokens
        losses.append(float(objective.detach()))
        aux = model.auxiliary_loss()
        assert (aux is not None) == (model.cfg.attention.kind == "moh")
        optimizer.zero_grad()
        (objective if aux is None else objective + aux).backward()
        optimizer.step()
    assert math.isfinite(losses[-1]) and losses[-1] < 0.05, f"loss {losses[-1]:.3f} after {len(losses)} steps"


def test_recompute_gives_the_same_gradients_with_dropout():
    """Activation checkpointing replays the dropout masks, so gradients are unchanged."""
    cfg = ModelConfig(
        vocab_size=50, n_encoder_layers=2, n_decoder_layers=2, d_model=32, n_heads=4, d_ff=64, dropout=0.3
    )
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 6))
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = Transformer(cfg).train()
        model.recompute = recompute
        calls = []
        model.encoder_layers[0].register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        torch.manual_seed(1)
        label_smoothed_loss(model(src, tgt[:, :-1]), tgt[:, 1:], 0, 0.1)[0].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert len(calls) == (2 if recompute else 1)  # recomputed in the backward pass
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_training_loss_is_the_reference_label_smoothed_loss():
    torch.manual_seed(0)
    logits, target = torch.randn(3, 5, 11), torch.randint(1, 11, (3, 5))
    target[1, 2:] = 0
    torch.testing.assert_close(
        smoothed_cross_entropy(logits, target, 0, 0.1), label_smoothed_loss(logits, target, 0, 0.1)[0]
    )


def test_rdrop_regularizer_is_the_symmetric_kl_over_real_tokens():
    torch.manual_seed(0)
    a, b = torch.randn(2, 4, 9), torch.randn(2, 4, 9)
    keep = torch.tensor([[True, True, True, False], [True, True, False, False]])
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    kl = lambda p, q: F.kl_div(q, p, log_target=True, reduction="none").sum(-1)  # KL(p || q)  # noqa: E731
    expected = ((kl(la, lb) + kl(lb, la)) / 2)[keep].sum()
    torch.testing.assert_close(symmetric_kl(a, b, keep), expected)
    assert symmetric_kl(a, a, keep).item() == pytest.approx(0.0, abs=1e-6)


def test_bf16_autocast_is_chosen_only_for_cpus_with_bf16_matrix_instructions(monkeypatch):
    def cpuinfo(flags: str) -> str:
        return f"processor\t: 0\nmodel name\t: some CPU\nflags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\n"

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # a process kept to AVX2 (isa=avx2) may not use them
    assert not cpu_has_bf16_matmul(cpuinfo("avx512f amx_bf16 amx_tile"))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")  # the flags alone decide below, whatever limit this process runs under
    assert cpu_has_bf16_matmul(cpuinfo("avx512f amx_bf16 amx_tile"))  # Intel AMX
    assert cpu_has_bf16_matmul(cpuinfo("avx512f avx512_bf16"))  # AVX512-BF16, e.g. AMD Zen 4
    assert not cpu_has_bf16_matmul(cpuinfo("avx512f avx512_vnni"))  # bf16 would be emulated
    assert not cpu_has_bf16_matmul("model name\t: avx512_bf16 in a name is not a flag\n")
    assert autocast_dtype("fp32", torch.device("cpu")) is None
    assert autocast_dtype("bf16", torch.device("cpu")) is torch.bfloat16


def test_compiling_on_a_cpu_without_a_cpp_compiler_is_refused_before_training(tmp_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    missing = DataConfig(dir=str(tmp_path / "no-corpus"))  # without the check, the run fails at once on this
    cfg = Config(data=missing, trainer=TrainerConfig(device="cpu", compile=True))
    with pytest.raises(ConfigError, match="trainer.compile=true needs a C\\+\\+ compiler"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
    require_cpp_compiler(torch.device("cuda"))  # GPUs compile without one
    monkeypatch.setenv("CXX", "/opt/bin/c++")
    monkeypatch.setattr("shutil.which", lambda name: name if name == "/opt/bin/c++" else None)
    require_cpp_compiler(torch.device("cpu"))  # the compiler CXX names


def test_the_trainers_fused_adam_updates_like_torchs_default_adam():
    torch.manual_seed(0)
    # No biases: the key bias's true gradient is zero, and Adam scales what rounding leaves of it to
    # full-size steps, so the two implementations' different roundings would give different weights.
    cfg = ModelConfig(
        vocab_size=50, n_encoder_layers=1, n_decoder_layers=1, d_model=32, n_heads=4, d_ff=64, dropout=0.0, bias=False
    )
    fused_model, foreach_model = Transformer(cfg), Transformer(cfg)
    foreach_model.load_state_dict(fused_model.state_dict())
    start = fused_model.output_weight.detach().clone()
    cpu = torch.device("cpu")
    fused = adam(fused_model.parameters(), 1e-2, (0.9, 0.98), 1e-9, 0.01, cpu)
    foreach = adam(foreach_model.parameters(), 1e-2, (0.9, 0.98), 1e-9, 0.01, cpu, fused=False)
    assert fused.defaults["fused"] and not foreach.defaults["fused"]
    src, tgt = torch.randint(1, 50, (3, 7)), torch.randint(1, 50, (3, 6))
    for _ in range(5):
        for model, optimizer in ((fused_model, fused), (foreach_model, foreach)):
            optimizer.zero_grad()
            model(src, tgt).square().mean().backward()
            optimizer.step()
    for (name, a), b in zip(fused_model.named_parameters(), foreach_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.allclose(fused_model.output_weight, start)  # the updates did move the weights


@pytest.mark.parametrize("fused", [True, False])
def test_decoupled_weight_decay_shrinks_the_weights_apart_from_the_gradient(fused):
    """With a zero gradient, AdamW's first step multiplies each weight by 1 - lr * weight_decay; the
    L2 form puts weight_decay * w into the gradient, which Adam rescales to a step of lr."""
    shrunk = {}
    for decoupled in (True, False):
        weight = torch.nn.Parameter(torch.full((3,), 2.0))
        tcfg = TrainerConfig(lr=0.1, weight_decay=0.5, decoupled_weight_decay=decoupled)
        if fused:  # what the Trainer builds
            optimizer = trainer_adam([weight], tcfg, torch.device("cpu"))
        else:
            optimizer = adam([weight], 0.1, tcfg.betas, tcfg.eps, 0.5, torch.device("cpu"), False, decoupled)
        weight.grad = torch.zeros(3)
        optimizer.step()
        shrunk[decoupled] = weight.detach()
    torch.testing.assert_close(shrunk[True], torch.full((3,), 2.0 * (1 - 0.1 * 0.5)))
    torch.testing.assert_close(shrunk[False], torch.full((3,), 2.0 - 0.1))


def test_inference_after_a_fused_adam_step_uses_the_updated_weights():
    """Inference on the fast path caches reordered weights until their version changes; the fused
    update does not change it, so the step hook that `accelerate` installs must."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, n_encoder_layers=1, n_decoder_layers=1, d_model=32, n_heads=4, d_ff=64)
    model = accelerate(Transformer(cfg), RuntimeConfig())
    optimizer = adam(model.parameters(), 1e-2, (0.9, 0.98), 1e-9, 0.0, torch.device("cpu"))
    src, tgt = torch.randint(1, 50, (3, 7)), torch.randint(1, 50, (3, 6))
    for _ in range(2):  # inference, as validation does, fills the caches; then one update
        with torch.no_grad():
            model.eval()(src, tgt)
        optimizer.zero_grad()
        model.train()(src, tgt).square().mean().backward()
        optimizer.step()
    fresh = Transformer(cfg)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(src, tgt), fresh.eval()(src, tgt))


@pytest.mark.parametrize("rdrop", [0.0, 0.5])
def test_the_runtime_chooses_the_chunked_loss_or_the_reference_logits_and_both_train_alike(
    tmp_path, tiny_corpus, rdrop
):
    """runtime.fast=false trains on the full logits with the reference objective; the default
    computes the output layer and loss in chunks (not with R-Drop, whose KL needs the logits).
    The first step's loss is the same either way."""
    from transformer.data import DataConfig, load_split

    ds = load_split(DataConfig(dir=str(tiny_corpus)), "train").select(range(12))
    tokenizer = Tokenizer.train(list(ds["src"]) + list(ds["tgt"]), vocab_size=120, model_type="unigram")
    corpus = tokenize(ds, tokenizer)
    batch = collate(corpus, list(range(len(corpus))), tokenizer)
    model_cfg = ModelConfig(
        len(tokenizer), n_encoder_layers=1, n_decoder_layers=1, d_model=32, n_heads=4, d_ff=64, dropout=0.0
    )
    losses = {}
    for fast in (True, False):
        trainer_cfg = TrainerConfig(device="cpu", precision="fp32", rdrop=rdrop)
        cfg = Config(model=model_cfg, trainer=trainer_cfg, runtime=RuntimeConfig(fast=fast))
        torch.manual_seed(0)
        model = accelerate(Transformer(model_cfg), cfg.runtime)
        trainer = Trainer(cfg, tmp_path / f"fast={fast}", model, tokenizer, corpus, corpus)
        assert trainer.chunked_loss == fast
        losses[fast] = trainer.train_step([batch])
    torch.testing.assert_close(losses[True], losses[False])


def test_the_plan_estimates_the_budgets_epochs_and_picks_the_long_budgets_dropout():
    from transformer.training.plan import planned_dropout, planned_epochs

    assert planned_epochs(0.6, 0.02) == pytest.approx(30.0)  # 0.6 epochs in 2% of the budget
    tcfg = TrainerConfig(long_budget_epochs=24, long_budget_dropout=0.3)
    assert [planned_dropout(e, tcfg, 0.2) for e in (7.0, 23.9, 24.0, 30.0)] == [0.2, 0.2, 0.3, 0.3]
    assert planned_dropout(300.0, TrainerConfig(), 0.2) == 0.2  # long_budget_epochs=0: off
    with pytest.raises(ValueError, match="trainer.long_budget_dropout=1.0"):
        TrainerConfig(long_budget_dropout=1.0)


def test_set_dropout_changes_the_residual_and_embedding_dropout_only_and_not_the_config():
    model = Transformer(ModelConfig(100, n_encoder_layers=2, n_decoder_layers=2, d_model=16, n_heads=2, d_ff=32,
                                    dropout=0.2, activation_dropout=0.15, attention_dropout=0.1))  # fmt: skip
    before = {name: m.p for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    model.set_dropout(0.3)
    after = {name: m.p for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {name for name, p in before.items() if p == 0.2} and len(changed) == 1 + 2 * 2 + 2 * 3
    assert all(after[name] == 0.3 for name in changed) and model.cfg.dropout == 0.2  # as configured, saved
    assert {m.dropout for m in model.modules() if hasattr(m, "dropout") and isinstance(m.dropout, float)} == {0.1}


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("g++") is None, reason="compiling needs a C++ compiler")
def test_training_with_the_compiled_step_validates_and_tests_as_eager_training(tmp_path, shared_corpus):
    """runtime.compiled_step=true: three validations score as without it (they decode eagerly, the
    weights change between them), the same best checkpoint, and the test split, translated by a
    program compiled for the best weights, gives the eager run's translations."""
    runs = {}
    for setting in ("false", "true"):
        run_dir = tmp_path / setting
        done = forked.run(
            ["train.py", "experiment=smoke", f"data.dir={shared_corpus}", "trainer.max_steps=30",
             "trainer.eval_every=10", "trainer.precision=fp32", "runtime.onednn_linear=false", "decode.beam_size=1",
             "decode.max_len_b=10", "trainer.attention_images=false", f"runtime.compiled_step={setting}", f"hydra.run.dir={run_dir}"],
            env={"TRANSFORMER_CACHE_DIR": str(tmp_path / "cache")},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        valid = [(r["step"], r["valid_chrf"], r["valid_loss"]) for r in records if "valid_loss" in r]
        best = torch.load(run_dir / "checkpoint_best.pt", weights_only=False)["step"]
        hyps = {p.name: p.read_text() for p in sorted(run_dir.glob("test*.en"))}
        runs[setting] = valid, best, hyps, done.stderr + done.stdout
    assert len(runs["true"][0]) == 3 and runs["true"][:3] == runs["false"][:3]
    assert runs["true"][2], "the test split's translations"
    log = runs["true"][3]
    assert "validations decode with eager steps" in log and "steps after the first run" in log
