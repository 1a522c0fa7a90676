"""Crashes at every phase of a validation's checkpoint writes, then a resume: the run ends exactly as
an uninterrupted one (weights, best checkpoint, numbered checkpoints, metrics.jsonl line for line).
Also: a run that cannot train stops at once, a refused or mistyped run leaves the earlier run
untouched, and a resumed run accounts its time and its best checkpoint across the restart."""

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch

from transformer import checkpoint

from . import forked

pytestmark = pytest.mark.e2e  # every test runs train.py

TRAIN = ["experiment=smoke", "data.vocab_size=300", "trainer.max_steps=12", "trainer.eval_every=2",
         "trainer.log_every=1", "trainer.keep_last=2", "trainer.eval_bleu=false", "data.test_splits=[]"]  # fmt: skip
TIMING = ("tokens_per_s", "train_minutes")  # the only fields two identical runs may differ in


def train(run_dir: Path, corpus: Path, *extra: str, crash: tuple = ()) -> subprocess.CompletedProcess:
    """train.py, or with crash=(what, step, phase) tests/crash_driver.py killing it at that moment
    (each its own process, forked from a warm interpreter: tests/forked.py)."""
    driver = ["tests/crash_driver.py", *map(str, crash)] if crash else ["train.py"]
    return forked.run([*driver, *TRAIN, f"data.dir={corpus}", f"hydra.run.dir={run_dir}", *extra], timeout=600)


def outcome(run_dir: Path) -> dict:
    """What must not depend on crashes: every checkpoint's step and weights, and the metrics."""
    files = [run_dir / "checkpoint_last.pt", run_dir / "checkpoint_best.pt", *checkpoint.numbered(run_dir)]
    payloads = {p.name: checkpoint.load(p) for p in files}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "checkpoints": {name: (p["step"], p["model"]) for name, p in payloads.items()},
        "metrics": [{k: v for k, v in r.items() if k not in TIMING} for r in records],
    }


def assert_same(got: dict, expected: dict) -> None:
    assert got["metrics"] == expected["metrics"]
    assert sorted(got["checkpoints"]) == sorted(expected["checkpoints"])
    for name, (step, weights) in expected["checkpoints"].items():
        got_step, got_weights = got["checkpoints"][name]
        assert got_step == step, name
        assert all(torch.equal(weights[k], got_weights[k]) for k in weights), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shared_corpus) -> dict:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = train(run_dir, shared_corpus)
    assert result.returncode == 0, result.stderr[-2000:]
    return outcome(run_dir)


# Each chain crashes at three validations in turn (resuming after each): while writing the numbered
# checkpoint of step 2, checkpoint_last.pt of step 4 and checkpoint_best.pt of step 6 (the
# validation loss still falls there, so each validation writes all three), at one phase.
PHASES = ["before", "during", "unrenamed", "after"]
CHAINS = {phase: [("numbered", 2, phase), ("checkpoint_last.pt", 4, phase), ("checkpoint_best.pt", 6, phase)] for phase in PHASES}  # fmt: skip
CHAINS["validation"] = [("validation", 4, "during"), ("validation", 10, "during")]


@pytest.mark.parametrize("chain", CHAINS, ids=list(CHAINS))
def test_a_crash_at_any_phase_of_a_checkpoint_write_resumes_to_the_uninterrupted_run(
    chain, tmp_path, shared_corpus, uninterrupted
):
    run_dir = tmp_path / "run"
    for crash in CHAINS[chain]:
        killed = train(run_dir, shared_corpus, crash=crash)
        assert killed.returncode == 137, f"{crash} was never reached: {killed.stderr[-2000:]}"
    resumed = train(run_dir, shared_corpus)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed at step" in resumed.stdout
    assert not list(run_dir.glob(".*.tmp"))  # what the crashes left half-written is gone
    assert_same(outcome(run_dir), uninterrupted)


def test_resuming_into_a_new_directory_carries_the_best_checkpoint(tmp_path, shared_corpus):
    """The best weights travel inside checkpoint_last.pt: a run resumed elsewhere that validates no
    better (here: not at all, its budget is spent) still has the right checkpoint_best.pt."""
    first, second = tmp_path / "first", tmp_path / "second"
    bleu = ["trainer.eval_bleu=true", "trainer.attention_images=false", "trainer.max_steps=6"]
    assert train(first, shared_corpus, *bleu).returncode == 0
    result = train(second, shared_corpus, *bleu, f"trainer.resume={first}")
    assert result.returncode == 0, result.stderr[-2000:]
    best, copied = checkpoint.load(first / "checkpoint_best.pt"), checkpoint.load(second / "checkpoint_best.pt")
    assert copied["step"] == best["step"]
    assert all(torch.equal(best["model"][k], copied["model"][k]) for k in best["model"])
    assert json.loads((second / "results.json").read_text())["best_step"] == best["step"]


def test_a_finished_run_run_again_reports_the_same_time_and_throughput(tmp_path, shared_corpus):
    run_dir = tmp_path / "run"
    assert train(run_dir, shared_corpus).returncode == 0
    before = json.loads((run_dir / "results.json").read_text())
    again = train(run_dir, shared_corpus)
    assert again.returncode == 0, again.stderr[-2000:]
    after = json.loads((run_dir / "results.json").read_text())
    # The same up to the checkpoint writes after the last validation, which the saved clock leaves out.
    assert after["train_minutes"] == pytest.approx(before["train_minutes"], abs=0.01)
    assert after["tokens_per_s"] == pytest.approx(before["tokens_per_s"], rel=0.1)


def test_a_run_with_no_training_pairs_left_stops_at_once_with_an_error(tmp_path, shared_corpus):
    result = train(tmp_path / "run", shared_corpus, "data.max_len=2")  # the timeout catches a hang
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no training pairs left" in result.stderr and "data.max_len=2" in result.stderr


def digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "train.log"}  # fmt: skip


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.overwrite=true", "data.dir=/nonexistent/corpus"], "/nonexistent/corpus"),
        (["trainer.overwrite=true", "data.test_splits=[test_2099]"], "test_2099"),
        (["trainer.overwrite=true", "data.max_len=2"], "data.max_len"),
        (["model.d_ff=128"], "already holds another run"),
    ],
    ids=["overwrite-missing-data", "overwrite-missing-test-split", "overwrite-no-pairs", "another-config"],
)
def test_a_refused_run_leaves_the_earlier_run_byte_for_byte(tmp_path, shared_corpus, overrides, message):
    """Nothing of an existing run (checkpoints, tokenizer, metrics, TensorBoard, the record of its
    config in .hydra/) changes until the new run is known to start. train.log gets the refusal."""
    run_dir = tmp_path / "run"
    assert train(run_dir, shared_corpus, "trainer.max_steps=2").returncode == 0
    before = digests(run_dir)
    assert ".hydra/config.yaml" in before and "checkpoint_best.pt" in before
    refused = train(run_dir, shared_corpus, "trainer.max_steps=2", *overrides)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert message in refused.stderr
    assert digests(run_dir) == before


def test_overwrite_replaces_the_earlier_run_once_the_new_one_starts(tmp_path, shared_corpus):
    run_dir = tmp_path / "run"
    assert train(run_dir, shared_corpus, "trainer.max_steps=4").returncode == 0
    again = train(run_dir, shared_corpus, "trainer.max_steps=2", "trainer.overwrite=true", "model.d_ff=128")
    assert again.returncode == 0, again.stderr[-2000:]
    assert [p.name for p in checkpoint.numbered(run_dir)] == ["checkpoint_2.pt"]
    assert "d_ff: 128" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 2]
