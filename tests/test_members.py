"""Several models trained at once and ensembled (trainer.members): one command from training to
the ensemble's test scores, members that differ but share one vocabulary, reruns that resume or
are refused without harm, and the settings it cannot run with."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from transformer import checkpoint
from transformer.config import Config
from transformer.data import corpus_file, read_lines
from transformer.errors import ConfigError
from transformer.evaluation import score
from transformer.training import run
from transformer.training.config import TrainerConfig
from transformer.training.members import candidates, member_configs

from . import forked
from .conftest import ROOT

# No attention images: drawing them took most of each validation, and no test here looks at them.
TRAIN = ["experiment=smoke", "data.max_tokens=600", "trainer.precision=fp32", "trainer.threads=2",
         "trainer.members=2", "trainer.eval_every=5", "trainer.max_steps=10", "trainer.average_last=2",
         "decode.beam_size=2", "trainer.attention_images=false"]  # fmt: skip


def command(run_dir, corpus, *extra):
    return [sys.executable, "train.py", *TRAIN, f"data.dir={corpus}", f"hydra.run.dir={run_dir}", *extra]


def train(run_dir, corpus, *extra) -> subprocess.CompletedProcess:
    """train.py, its own process forked from a warm interpreter (tests/forked.py)."""
    return forked.run(command(run_dir, corpus, *extra)[1:])


@pytest.mark.e2e
def test_members_train_at_once_and_validation_chooses_their_ensemble(tmp_path, tiny_corpus):
    run_dir = tmp_path / "run"
    done = train(run_dir, tiny_corpus)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert [member["steps"] for member in results["members"]] == [10, 10]
    ensembles = results["ensembles"]
    assert set(ensembles) == {"best", "avg2", "best+avg2"}
    assert len(ensembles["best+avg2"]["checkpoints"]) == 4
    assert results["valid_best"] == max(option["valid_bleu"] for option in ensembles.values())
    assert ensembles[results["chosen"]]["valid_bleu"] == results["valid_best"]
    assert set(results["test"]) == {"test_2016_flickr/greedy", "test_2016_flickr/beam2"}
    assert len((run_dir / "test_2016_flickr.ensemble.beam2.en").read_text().splitlines()) == 40
    valid_hyps = read_lines(run_dir / "val.ensemble.beam2.en")  # the chosen ensemble's, as scored
    assert score(valid_hyps, read_lines(corpus_file(tiny_corpus, "val", "en"))).bleu == pytest.approx(
        results["valid_best"]
    )

    payloads = [checkpoint.load(run_dir / f"member{i}" / "checkpoint_best.pt") for i in (0, 1)]
    vocabulary = (run_dir / "spm.model").read_bytes()
    assert all(p["tokenizer"].numpy().tobytes() == vocabulary for p in payloads)
    assert [p["train_config"]["seed"] for p in payloads] == [1, 2]
    assert [p["train_config"]["trainer"]["threads"] for p in payloads] == [1, 1]
    weights = [p["model"]["embed.embed.weight"] for p in payloads]
    assert not torch.equal(*weights), "the members are the same model"

    table = forked.run(["scripts/lab/results_table.py", f"run={run_dir}"])
    assert table.returncode == 0, table.stderr[-2000:]
    assert f"ensemble of 2 members ({results['chosen']}, chosen on val)" in table.stdout
    assert "member 0: 10 steps" in table.stdout and "member 1: 10 steps" in table.stdout


@pytest.mark.e2e
def test_a_rerun_resumes_the_members_and_other_settings_leave_them_intact(tmp_path, tiny_corpus):
    run_dir, untested = tmp_path / "run", "data.test_splits=[]"  # the test splits' decoding is the test above's
    assert train(run_dir, tiny_corpus, untested, "trainer.max_steps=5").returncode == 0
    saved = {i: (run_dir / f"member{i}" / "checkpoint_5.pt").read_bytes() for i in (0, 1)}

    refused = train(run_dir, tiny_corpus, untested, "trainer.max_steps=5", "model.d_ff=128")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "already holds another run" in refused.stderr and "model.d_ff" in refused.stderr
    assert "member0, member1 stopped without finishing" in refused.stderr

    again = train(run_dir, tiny_corpus, untested, "trainer.max_steps=10")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "member0: resumed at step 5" in again.stdout and "member1: resumed at step 5" in again.stdout
    for i in (0, 1):
        assert (run_dir / f"member{i}" / "checkpoint_5.pt").read_bytes() == saved[i]
    assert [m["steps"] for m in json.loads((run_dir / "results.json").read_text())["members"]] == [10, 10]


def start_long_run(run_dir, corpus, stderr_path) -> subprocess.Popen:
    """A members run that would train for minutes, once both members have saved a checkpoint."""
    with open(stderr_path, "w") as stderr:  # a file: a pipe nobody reads could fill and block
        cmd = command(run_dir, corpus, "trainer.max_steps=100000", "trainer.max_minutes=3")
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    deadline = time.monotonic() + 300
    while not all((run_dir / f"member{i}" / "checkpoint_last.pt").is_file() for i in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, stderr_path.read_text()[-2000:]
        time.sleep(0.05)
    return proc


def interrupted(run_dir) -> list[bool]:
    return [f"interrupted by signal {int(signal.SIGTERM)}" in (run_dir / f"member{i}" / "train.log").read_text() for i in (0, 1)]  # fmt: skip


@pytest.mark.e2e
def test_sigterm_to_the_command_stops_every_member_and_says_how_to_resume(tmp_path, tiny_corpus):
    run_dir, stderr = tmp_path / "run", tmp_path / "stderr.txt"
    proc = start_long_run(run_dir, tiny_corpus, stderr)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    text = stderr.read_text()
    assert "Traceback" not in text and f"hydra.run.dir={run_dir}" in text.strip().splitlines()[-1]
    assert interrupted(run_dir) == [True, True]  # both had saved and stopped before the command returned


@pytest.mark.e2e
def test_members_stop_by_themselves_when_the_command_is_killed(tmp_path, tiny_corpus):
    run_dir = tmp_path / "run"
    proc = start_long_run(run_dir, tiny_corpus, tmp_path / "stderr.txt")
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    while not all(interrupted(run_dir)):
        assert time.monotonic() < deadline, "a member went on training after the command was killed"
        time.sleep(0.1)


def test_members_get_their_own_seed_and_a_share_of_the_threads():
    cfg = Config(seed=7, trainer=TrainerConfig(members=3, threads=6))
    configs = member_configs(cfg)
    assert [c.seed for c in configs] == [7, 8, 9]
    assert {(c.trainer.threads, c.trainer.members) for c in configs} == {(2, 1)}
    one_core = member_configs(Config(trainer=TrainerConfig(members=4, threads=2)))
    assert {c.trainer.threads for c in one_core} == {1}


def test_averages_join_the_candidates_only_when_every_member_wrote_one(tmp_path):
    dirs = [tmp_path / "member0", tmp_path / "member1"]
    for d in dirs:
        d.mkdir()
        (d / "results.json").write_text("{}")
        (d / "checkpoint_avg2.pt").touch()  # left by an earlier run: not this run's average
    assert list(candidates(dirs)) == ["best"]
    average = {"average": {"checkpoints": [f"checkpoint_{step}.pt" for step in (250, 500, 750, 1000, 1250)]}}
    (dirs[0] / "results.json").write_text(json.dumps(average))
    assert list(candidates(dirs)) == ["best"]
    (dirs[1] / "results.json").write_text(json.dumps(average))
    options = candidates(dirs)
    assert list(options) == ["best", "avg5", "best+avg5"]
    assert options["best+avg5"] == [d / name for name in ("checkpoint_best.pt", "checkpoint_avg5.pt") for d in dirs]


def test_settings_members_cannot_run_with_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="trainer.resume"):
        run(Config(trainer=TrainerConfig(members=2, resume=str(tmp_path))), tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun"):
        run(Config(trainer=TrainerConfig(members=2)), tmp_path)
    with pytest.raises(ValueError, match="trainer.members=0"):
        TrainerConfig(members=0)
