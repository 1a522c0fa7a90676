"""Reliability: exact resume after SIGKILL, graceful SIGTERM, crash-safe saves, refusing to mix
runs, and stopping on non-finite values."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from transformer import checkpoint
from transformer.data import corpus_file, read_lines
from transformer.data.tokenizer import Tokenizer
from transformer.model import ModelConfig, Transformer
from transformer.training.resume import config_differences

from . import forked
from .conftest import ROOT, write_corpus

# A small model (narrowed: its 3+3 layers and dropout 0.3 at half the width) on the tiny corpus:
# slow enough (~0.1 s a step) to be interrupted mid-run.
MODEL = ["model=small", "model.d_model=128", "model.d_ff=512"]
TRAIN = ["experiment=smoke", *MODEL, "data.max_tokens=600", "trainer.precision=fp32", "trainer.threads=1",
         "trainer.log_every=1", "trainer.eval_every=10", "trainer.eval_bleu=false", "data.test_splits=[]"]  # fmt: skip


def command(run_dir, corpus, *extra):
    return [sys.executable, "train.py", *TRAIN, f"data.dir={corpus}", f"hydra.run.dir={run_dir}", *extra]


def train(run_dir, corpus, *extra) -> subprocess.CompletedProcess:
    """train.py to its end, its own process forked from a warm interpreter (tests/forked.py)."""
    return forked.run(command(run_dir, corpus, *extra)[1:])


def losses(run_dir) -> dict[int, float]:
    """step -> training loss, the last record of each step (a resumed run rewrites later steps)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


# train.py, killed (SIGKILL) once the loss of step int(sys.argv[1]) is in metrics.jsonl: mid-epoch,
# between checkpoints, whatever the CPU's speed. Run as `python -c KILLED_AFTER_STEP STEP overrides...`.
KILLED_AFTER_STEP = """
import os, runpy, signal, sys
from transformer import monitoring

record, step = monitoring.Monitor.record, int(sys.argv[1])

def record_or_die(self, values):
    record(self, values)
    if values.get("step") == step and "loss" in values:
        os.kill(os.getpid(), signal.SIGKILL)

monitoring.Monitor.record = record_or_die
sys.argv = ["train.py", *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
"""


def start_and_wait(cmd, run_dir, min_step: int) -> subprocess.Popen:
    """Start training and return once metrics.jsonl shows a step >= min_step."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and max(losses(run_dir), default=0) >= min_step:
            return proc
        time.sleep(0.02)
    raise AssertionError(f"training did not reach step {min_step}: {proc.communicate()[1][-2000:]}")


@pytest.mark.e2e
@pytest.mark.parametrize("runtime", ["fast", "reference"])
def test_resume_after_sigkill_reproduces_every_later_loss(tmp_path, tiny_corpus, runtime):
    # The linear schedule's decay depends on where warmup ended: the resumed run must restore it.
    # Subword sampling draws each epoch's segmentation anew: the resumed run must draw the same.
    # A long budget's dropout, chosen at step 2, must hold after the resume too.
    # Half the tiny corpus, so that 24 steps hold two epochs.
    write_corpus(tiny_corpus, "train", {lang: read_lines(corpus_file(tiny_corpus, "train", lang))[:200] for lang in ("de", "en")})  # fmt: skip
    schedule = ["trainer.max_steps=24", "trainer.schedule=linear", "trainer.warmup_steps=5", "data.subword_alpha=0.3"]
    schedule += ["trainer.long_budget_epochs=1", "trainer.long_budget_dropout=0.05"]  # model=small: 0.3
    schedule.append(f"runtime={runtime}")
    full = tmp_path / "full"
    done = train(full, tiny_corpus, *schedule)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(estimated at step 2), trainer.long_budget_epochs=1: dropout 0.05 from the next step on" in done.stdout
    records = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in records if "lr" in r}
    for step in (5, 10, 20, 23, 24):  # linear from the peak at the end of warmup towards 0 after max_steps
        assert lr[step] == pytest.approx(lr[5] * (25 - step) / (25 - 5), abs=1e-12)
    assert lr[3] == pytest.approx(lr[5] * 3 / 5)
    assert {r["step"]: r["epoch"] for r in records if "loss" in r}[14] == 2  # the kill below follows a new draw

    killed = tmp_path / "killed"
    died = subprocess.run([sys.executable, "-c", KILLED_AFTER_STEP, "14", *command(killed, tiny_corpus, *schedule)[2:]],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    resumed_from = checkpoint.load(killed / "checkpoint_last.pt")["step"]
    assert resumed_from == 10
    again = train(killed, tiny_corpus, *schedule)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed at step {resumed_from}" in again.stdout

    expected, got = losses(full), losses(killed)
    later = [s for s in expected if s > resumed_from]
    assert later and max(abs(expected[s] - got[s]) for s in later) == 0.0


@pytest.mark.e2e
def test_checkpoints_keep_the_configured_dropout_and_the_state_keeps_the_planned_one(tmp_path, tiny_corpus):
    """The budget's dropout (chosen at step 2) is the run's state, not the model's config: a
    checkpoint's model config, which decoding and fine-tuning build from, says model.dropout."""
    run_dir = tmp_path / "run"
    plan = ["trainer.max_steps=4", "trainer.eval_every=2", "trainer.long_budget_epochs=0.1", "trainer.long_budget_dropout=0.05"]  # fmt: skip
    done = train(run_dir, tiny_corpus, *plan)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(estimated at step 2), trainer.long_budget_epochs=0.1: dropout 0.05 from the next step on" in done.stdout
    saved = {path.name: checkpoint.load(path) for path in sorted(run_dir.glob("checkpoint_*.pt"))}
    assert set(saved) == {"checkpoint_2.pt", "checkpoint_4.pt", "checkpoint_best.pt", "checkpoint_last.pt"}
    assert {name: payload["model_config"]["dropout"] for name, payload in saved.items()} == dict.fromkeys(saved, 0.3)
    assert saved["checkpoint_last.pt"]["train_state"]["planned_dropout"] == 0.05


@pytest.mark.e2e
def test_a_wall_clock_budget_decays_the_learning_rate_to_zero_by_its_end(tmp_path, tiny_corpus):
    # The clock alone ends the run (no step budget within reach), and experiment=smoke's tiny model
    # (not TRAIN's small model) takes hundreds of steps in the budget, dozens on a loaded CPU: each
    # step is a small part of the budget, so the last one starts near its end.
    run = tmp_path / "run"
    settings = [arg for arg in TRAIN if arg not in MODEL] + [f"data.dir={tiny_corpus}", f"hydra.run.dir={run}"]
    extra = ["trainer.max_minutes=0.05", "trainer.max_steps=1000000", "trainer.schedule=linear", "trainer.warmup_steps=5", "trainer.eval_every=1000"]  # fmt: skip
    done = forked.run(["train.py", *settings, *extra])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "reached trainer.max_minutes=0.05" in done.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lr = [r["lr"] for r in records if "lr" in r]
    assert len(lr) >= 10 and all(isinstance(x, float) for x in lr)
    peak = max(lr)
    assert lr.index(peak) == 4  # the end of warmup
    assert all(a >= b for a, b in zip(lr[4:], lr[5:]))  # then only down, with the clock
    assert lr[-1] < 0.15 * peak


def test_the_budget_may_change_on_resume_unless_the_schedule_depends_on_it():
    saved = {"trainer": {"max_steps": 100, "schedule": "inverse_sqrt", "cooldown": 0.0}}
    longer = {"trainer": {"max_steps": 200, "schedule": "inverse_sqrt", "cooldown": 0.0}}
    assert config_differences(saved, longer) == []
    for trainer in ({"schedule": "linear", "cooldown": 0.0}, {"schedule": "inverse_sqrt", "cooldown": 0.1}):
        before, after = {"trainer": {"max_steps": 100, **trainer}}, {"trainer": {"max_steps": 200, **trainer}}
        assert [d.split(" ")[0] for d in config_differences(before, after)] == ["trainer.max_steps"]


def test_the_budget_may_not_change_on_resume_when_it_chooses_the_dropout():
    before = {"trainer": {"max_steps": 100, "schedule": "inverse_sqrt", "long_budget_epochs": 20}}
    after = {"trainer": {"max_steps": 200, "schedule": "inverse_sqrt", "long_budget_epochs": 20}}
    assert [d.split(" ")[0] for d in config_differences(before, after)] == ["trainer.max_steps"]


def test_a_checkpoint_older_than_an_option_resumes_when_the_option_keeps_its_default():
    old = {"trainer": {"lr": 1e-3}}
    defaults = {"trainer": {"lr": 7e-4, "cooldown": 0.0}}
    assert config_differences(old, {"trainer": {"lr": 1e-3, "cooldown": 0.0}}, defaults) == []
    assert config_differences(old, {"trainer": {"lr": 1e-3, "cooldown": 0.2}}, defaults) == [
        "trainer.cooldown (0.0 in the checkpoint, 0.2 now)"
    ]


def test_a_checkpoint_with_an_option_since_removed_resumes_and_the_speed_paths_may_change():
    """trainer.chunked_loss became runtime.chunked_loss: checkpoints that hold the old key still
    resume, and the runtime (speed paths, the same computation) may differ from the checkpoint's."""
    old = {"trainer": {"lr": 1e-3, "chunked_loss": False}, "runtime": {"fast": True, "chunked_loss": True}}
    now = {"trainer": {"lr": 1e-3}, "runtime": {"fast": False, "chunked_loss": True}}
    assert config_differences(old, now) == []
    assert config_differences({"trainer": {"lr": 1e-3, "chunked_loss": False}}, now, {"runtime": {}}) == []
    assert config_differences(old, {"trainer": {"lr": 2e-3}}) == ["trainer.lr (0.001 in the checkpoint, 0.002 now)"]


@pytest.mark.e2e
def test_sigterm_saves_at_a_step_boundary_and_says_how_to_resume(tmp_path, tiny_corpus):
    run_dir = tmp_path / "run"
    proc = start_and_wait(command(run_dir, tiny_corpus, "trainer.max_steps=100000"), run_dir, min_step=3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in stderr and f"hydra.run.dir={run_dir}" in stderr
    saved = checkpoint.load(run_dir / "checkpoint_last.pt")
    assert f"at step {saved['step']};" in stderr and saved["step"] >= 3


@pytest.mark.e2e
def test_a_directory_with_another_run_is_refused_and_left_intact(tmp_path, tiny_corpus):
    run_dir = tmp_path / "run"
    first = train(run_dir, tiny_corpus, "trainer.max_steps=10")
    assert first.returncode == 0, first.stderr[-2000:]
    before = (run_dir / "checkpoint_last.pt").read_bytes()
    other = train(run_dir, tiny_corpus, "trainer.max_steps=10", "model.d_ff=128")
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert "already holds another run" in other.stderr and "model.d_ff" in other.stderr
    assert (run_dir / "checkpoint_last.pt").read_bytes() == before
    resume = train(tmp_path / "new", tiny_corpus, "model.d_ff=128", f"trainer.resume={run_dir}")
    assert resume.returncode == 2 and "cannot resume" in resume.stderr and "model.d_ff" in resume.stderr


def test_a_crash_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    tokenizer = Tokenizer.train(["ein hund", "a dog", "zwei katzen", "two cats"] * 10, vocab_size=30, model_type="char")
    model = Transformer(
        ModelConfig(vocab_size=len(tokenizer), n_encoder_layers=1, n_decoder_layers=1, d_model=16, n_heads=2, d_ff=32)
    )
    path = tmp_path / "checkpoint_last.pt"
    checkpoint.save(path, model, tokenizer, train_config={}, step=1)

    def crash(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, model, tokenizer, train_config={}, step=2)
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 1


@pytest.mark.e2e
def test_non_finite_losses_skip_updates_then_stop(tmp_path, tiny_corpus):
    result = train(tmp_path / "run", tiny_corpus, "trainer.lr=1e30", "trainer.warmup_steps=1", "trainer.max_bad_steps=2", "trainer.max_steps=200")  # fmt: skip
    assert result.returncode == 3, result.stderr[-2000:]
    assert "consecutive steps with non-finite loss or gradients" in result.stderr and "Traceback" not in result.stderr
    assert "update skipped" in result.stdout


@pytest.mark.e2e
def test_a_stop_just_after_a_validation_adds_no_near_copy_of_its_checkpoint(tmp_path, tiny_corpus):
    """The averaged checkpoints stay trainer.eval_every apart: a stop within a quarter of it after a
    validation saves only checkpoint_last.pt, and a later stop validates and numbers its checkpoint.
    On experiment=smoke's tiny model: nothing here depends on the model, or interrupts it."""
    settings = [arg for arg in TRAIN if arg not in MODEL] + [f"data.dir={tiny_corpus}"]
    for steps, numbered in ((21, [10, 20]), (13, [10, 13])):
        run_dir = tmp_path / f"run{steps}"
        result = forked.run(["train.py", *settings, f"hydra.run.dir={run_dir}", f"trainer.max_steps={steps}"])
        assert result.returncode == 0, result.stderr[-2000:]
        assert [int(p.stem.split("_")[1]) for p in checkpoint.numbered(run_dir)] == numbered
        assert torch.load(run_dir / "checkpoint_last.pt", weights_only=False)["step"] == steps
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert max(losses(run_dir)) == steps
        assert [r["step"] for r in records if "valid_loss" in r] == numbered
