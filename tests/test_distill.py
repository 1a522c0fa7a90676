"""Distillation (distill.py, transformer/training/distill.py): the filter's rules; the translate
stage writes what the teacher's translate.py writes; a pipeline killed in a stage and run again
ends as an uninterrupted one; a stage holding other inputs is refused, and a stage directory
distill.py did not write is never deleted; a bad teacher and an empty filtered set stop with one
error line and change nothing already saved."""

import gzip
import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from transformer import checkpoint
from transformer.data.tokenizer import Tokenizer
from transformer.decoding import DecodeConfig
from transformer.errors import ConfigError
from transformer.training.config import DistillConfig
from transformer.training.distill import differing, filter_pairs, stage_of

from . import forked
from .conftest import ROOT

pytestmark = pytest.mark.e2e

# The student: experiment=smoke's tiny model for a few steps; the teacher decodes with smoke's beam.
STUDENT = ["experiment=smoke", "trainer.max_steps=6", "trainer.eval_every=3", "trainer.eval_bleu=false"]


def run(args: list[str]) -> subprocess.CompletedProcess:
    """`python *args`, forked from a warm interpreter (tests/forked.py); `-c CODE` in a fresh one."""
    if args[0] == "-c":
        return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return forked.run(args)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, shared_corpus) -> Path:
    """A tiny de->en model trained long enough to write something for most sources."""
    run_dir = tmp_path_factory.mktemp("distill") / "teacher"
    args = ["train.py", "experiment=smoke", f"hydra.run.dir={run_dir}", f"data.dir={shared_corpus}", "data.vocab_size=300",
            "trainer.max_steps=60", "trainer.eval_every=60", "trainer.lr=3e-3", "trainer.eval_bleu=false", "data.test_splits=[]"]  # fmt: skip
    result = run(args)
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir / "checkpoint_best.pt"


def distill(teacher: Path, corpus: Path, run_dir: Path, *extra: str):
    args = ["distill.py", f"teacher={teacher}", f"data.dir={corpus}", f"hydra.run.dir={run_dir}", *STUDENT,
            "distill.max_length_ratio=100", *extra]  # fmt: skip
    return run(args)


def weights(path: Path) -> dict:
    return checkpoint.load(path)["model"]


def files_of(directory: Path) -> dict[str, str]:
    """Every file under `directory` -> its SHA-256, but the logs and manifests (they hold times)."""
    skip = {
        "distill.log",
        "train.log",
        "manifest.json",
        "shortlist.json",
        "distill.json",
        "metrics.jsonl",
        "results.json",
    }
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name not in skip and "tensorboard" not in p.parts and ".hydra" not in p.parts and not p.name.endswith(".pt"):  # fmt: skip
            out[str(p.relative_to(directory))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# --- the filter -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(shared_corpus) -> Tokenizer:
    with gzip.open(shared_corpus / "train.de.gz", "rt") as de, gzip.open(shared_corpus / "train.en.gz", "rt") as en:
        return Tokenizer.train(de.read().splitlines() + en.read().splitlines(), 300, "unigram")


def test_each_rule_drops_what_it_names_and_references_join_on_request(tokenizer):
    sources = ["Ein Hund läuft.", "Zwei Katzen.", "Ein Mann.", "Eine Frau singt.", "Ein Kind spielt.", "Ein Ball."]
    references = ["A dog runs.", "Two cats.", "A man.", "A woman sings.", "A child plays.", "A ball."]
    translations = [["A dog runs."], [""], ["Ein  mann."], ["A woman " + "sings loudly and for a long time " * 6], ["A kid plays."], ["A ball."]]  # fmt: skip
    scores = [[-0.1], [-0.1], [-0.1], [-0.1], [-2.5], [-0.2]]
    settings = DistillConfig(max_length_ratio=2.5, drop_worst=0.34)
    pairs, counts = filter_pairs(sources, references, translations, scores, tokenizer, settings)
    assert counts == {"translations": 6, "empty": 1, "copy": 1, "length": 1, "score": 1, "kept": 2, "references": 0}
    assert pairs == [("Ein Hund läuft.", "A dog runs."), ("Ein Ball.", "A ball.")]  # the kid's score was the worst
    settings = DistillConfig(max_length_ratio=2.5, drop_worst=0.0, references=True)
    pairs, counts = filter_pairs(sources, references, translations, scores, tokenizer, settings)
    assert counts["kept"] == 3 and counts["references"] == 6 and pairs[3:] == list(zip(sources, references))


def test_a_stages_changed_inputs_are_named_a_key_only_one_side_has_included():
    """A run directory kept from before a setting existed: its new key (null by default) is named
    in the refusal, which otherwise said 'they differ in )'."""
    earlier = {"decode": {"beam_size": 5}, "runtime": {"precision": "fp32"}}
    now = {"decode": {"beam_size": 4}, "runtime": {"precision": "fp32", "compiled_step": None}}
    assert differing(earlier, now) == ["decode.beam_size", "runtime.compiled_step"]
    assert differing(now, now) == []


def test_select_best_keeps_each_sources_translation_closest_to_its_reference(tokenizer):
    sources, references = ["Ein Hund läuft."], ["A dog runs."]
    translations, scores = [["A cat sleeps.", "A dog runs.", "One dog is running."]], [[-0.1, -0.5, -0.3]]
    for select, expected in (("best", [("Ein Hund läuft.", "A dog runs.")]), ("all", [(sources[0], t) for t in translations[0]])):  # fmt: skip
        pairs, _ = filter_pairs(sources, references, translations, scores, tokenizer, DistillConfig(select=select, drop_worst=0.0))  # fmt: skip
        assert pairs == expected


# --- the pipeline ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def distilled(teacher, shared_corpus, tmp_path_factory) -> dict[int, Path]:
    """n_best -> the run directory of a whole pipeline with the teacher's 1 (or 2, the best kept) best."""
    runs = {}
    for n_best in (1, 2):
        run_dir = tmp_path_factory.mktemp("distilled") / "run"
        extra = [f"distill.n_best={n_best}", "distill.chunk_lines=150"] + (
            ["distill.select=best"] if n_best > 1 else []
        )
        result = distill(teacher, shared_corpus, run_dir, *extra)
        assert result.returncode == 0, result.stderr[-2000:]
        runs[n_best] = run_dir
    return runs


@pytest.mark.parametrize("n_best", [1, 2])
def test_the_translate_stage_writes_what_the_teachers_translate_py_writes(teacher, distilled, shared_corpus, tmp_path, n_best):  # fmt: skip
    run_dir = distilled[n_best]
    output = tmp_path / "teacher.en"
    args = [
        "translate.py",
        f"checkpoint={teacher}",
        f"input={shared_corpus / 'train.de.gz'}",
        f"output={output}",
        "decode.max_len_b=5",
        f"decode.n_best={n_best}",
        "chunk_lines=150",
    ]  # smoke's decode, the stage's chunks (a batch's padding moves a score in its 4th decimal)
    translated = run(args)
    assert translated.returncode == 0, translated.stderr[-2000:]
    assert (run_dir / "translate" / "train.en").read_bytes() == output.read_bytes()
    summary = json.loads((run_dir / "distill.json").read_text())
    assert summary["filter"]["counts"]["translations"] == 400  # distill.select=best: one of each source's two
    assert (run_dir / "student" / "checkpoint_best.pt").is_file() and (run_dir / "student" / "shortlist.tsv").is_file()
    kept = (run_dir / "corpus" / "train.en").read_text().splitlines()
    assert len(kept) == summary["filter"]["counts"]["kept"] > 0


def test_the_students_benchmark_times_both_against_the_teachers_rows(teacher, distilled, shared_corpus, tmp_path):
    pytest.importorskip("ctranslate2")  # in the dev extra, which CI installs
    output = tmp_path / "students.json"
    args = ["benchmarks/compare_students.py", f"teacher={teacher}", f"student={distilled[1] / 'student' / 'checkpoint_best.pt'}",
            f"data_dir={shared_corpus}", "sentences=12", "rounds=1", "compiled=false", f"output={output}"]  # fmt: skip
    # compiled=false: the compiled rows would compile four programs (tests/test_compiled.py tests them)
    result = run(args)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(output.read_text())["rows"]
    assert {r["what"] for r in rows} == {"decoding alone", "whole process"} and len(rows) == 2 * (9 + 3)
    for r in rows:
        if r["decoder"] in ("teacher ours fp32", "teacher translate.py fp32"):
            assert r["vs_teacher_ours"] == 1.0
        if r["decoder"] == "teacher ctranslate2 float32":
            assert r["vs_teacher_ctranslate2"] == 1.0
        assert r["sentences_per_s"] > 0


# distill.py, killed (SIGKILL) in its translate stage once the chunk ending at source line
# int(sys.argv[1]) is appended to the outputs, before its progress is saved: what the resumed run
# must cut off. Run as `python -c KILLED_BEFORE_PROGRESS LINE distill.py-overrides...` in ROOT.
KILLED_BEFORE_PROGRESS = """
import importlib, json, os, runpy, signal, sys

module = importlib.import_module("transformer.training.distill")
write, line = module.atomic_write_text, int(sys.argv[1])

def write_or_die(path, text):
    if path.name == "progress.json" and json.loads(text)["lines"] == line:
        os.kill(os.getpid(), signal.SIGKILL)
    write(path, text)

module.atomic_write_text = write_or_die
sys.argv = ["distill.py", *sys.argv[2:]]
runpy.run_path("distill.py", run_name="__main__")
"""


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def test_a_pipeline_stopped_in_any_stage_resumes_to_the_uninterrupted_result(teacher, shared_corpus, tmp_path):
    whole = tmp_path / "whole"
    assert distill(teacher, shared_corpus, whole, "distill.chunk_lines=20").returncode == 0
    # Killed outright while translating, its second chunk appended but not its progress, then run again.
    killed = tmp_path / "killed"
    args = ["distill.py", f"teacher={teacher}", f"data.dir={shared_corpus}", f"hydra.run.dir={killed}", *STUDENT,
            "distill.max_length_ratio=100", "distill.chunk_lines=20"]  # fmt: skip
    died = run(["-c", KILLED_BEFORE_PROGRESS, "40", *args[1:]])
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    assert json.loads((killed / "translate" / "progress.json").read_text())["lines"] == 20
    assert len((killed / "translate" / "train.en").read_text().splitlines()) == 40  # the unsaved chunk's too
    again = run(args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "going on from source line 21 of 400" in again.stdout + again.stderr
    translations = [(d / "translate" / "train.en").read_text().splitlines() for d in (whole, killed)]
    assert translations[1] == translations[0]
    # Stopped by SIGTERM while the student trains, then run again.
    stopped = tmp_path / "stopped"
    args[3] = f"hydra.run.dir={stopped}"
    args.append("trainer.log_every=1")  # metrics.jsonl at the first step: the signal comes while training
    process = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for(stopped / "student" / "metrics.jsonl", process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate()
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert f"python distill.py <same overrides> hydra.run.dir={stopped}" in err
    again = run(args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "translate: done before" in again.stdout + again.stderr
    for other in (killed, stopped):
        assert files_of(other) == files_of(whole)
        tests = [json.loads((d / "student" / "results.json").read_text())["test"] for d in (whole, other)]
        assert tests[0] == tests[1] and tests[0]
        for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
            mine, theirs = weights(whole / "student" / name), weights(other / "student" / name)
            assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    # Run again as it was, every stage is skipped; with another setting, the stage is refused.
    again = run(args)
    assert again.returncode == 0 and again.stdout.count("done before") + again.stderr.count("done before") == 4
    before = files_of(stopped)
    refused = run([*args, "distill.drop_worst=0.2"])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "holds the filter stage of other inputs (they differ in settings.drop_worst)" in refused.stderr
    assert files_of(stopped) == before
    redone = run([*args, "distill.drop_worst=0.2", "distill.overwrite=true"])
    assert redone.returncode == 0, redone.stderr[-2000:]
    assert "translate: done before" in redone.stdout + redone.stderr
    assert len((stopped / "corpus" / "train.en").read_text().splitlines()) < len((whole / "corpus" / "train.en").read_text().splitlines())  # fmt: skip


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", ["translate", "corpus", "student"])
def test_a_stage_directory_distill_py_did_not_write_stops_the_run_and_stays(teacher, shared_corpus, tmp_path, directory):  # fmt: skip
    run_dir = tmp_path / "run"
    (run_dir / directory).mkdir(parents=True)
    (run_dir / directory / "notes.txt").write_text("mine\n")
    for overwrite in ("false", "true"):  # distill.overwrite redoes distill.py's own stages only
        before = files_of(run_dir)
        result = distill(teacher, shared_corpus, run_dir, f"distill.overwrite={overwrite}")
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert len(errors) == 1, result.stderr[-2000:]
        assert f"{run_dir / directory} was not written by distill.py" in errors[0] and "move it away" in errors[0]
        assert files_of(run_dir) == before and (run_dir / directory / "notes.txt").read_text() == "mine\n"


def test_a_stage_deletes_only_what_holds_its_record(tmp_path):
    """Unrecorded content is refused, with distill.overwrite too; a record's temporary file left by
    a kill is the stage's own; the stage's own earlier outputs go on distill.overwrite."""
    inputs = {"source": "a"}
    for name, what in (("translate", "translate/train.en"), ("filter", "corpus/train.en"), ("train", "student/x.pt"), ("shortlist", "student/shortlist.tsv")):  # fmt: skip
        run_dir = tmp_path / name
        (run_dir / what).parent.mkdir(parents=True)
        (run_dir / what).write_text("mine\n")
        for overwrite in (False, True):
            with pytest.raises(ConfigError, match="was not written by distill.py"):
                stage_of(name, run_dir, inputs, overwrite).start()
            assert (run_dir / what).read_text() == "mine\n"
        (run_dir / what).unlink()
        stage = stage_of(name, run_dir, inputs)
        (stage.directory / f".{stage.inputs_path.name}.123-abcd.tmp").write_text("{")
        assert stage.start() is False and stage.earlier() == inputs
        (run_dir / what).write_text("its own\n")
        with pytest.raises(ConfigError, match="holds the .* stage of other inputs"):
            stage_of(name, run_dir, {"source": "b"}).start()
        assert stage_of(name, run_dir, {"source": "b"}, overwrite=True).start() is False
        assert not (run_dir / what).exists() and stage.earlier() == {"source": "b"}


def another_vocabulary(teacher: Path, directory: Path, shared_corpus: Path) -> Path:
    """The teacher with another tokenizer of the same size (trained on its corpus' English side only)."""
    payload = checkpoint.load(teacher)
    with gzip.open(shared_corpus / "train.en.gz", "rt") as f:
        other = Tokenizer.train(f.read().splitlines(), len(checkpoint.tokenizer_of(payload)), "unigram")
    payload["tokenizer"] = checkpoint.as_tensor(other.model_bytes)
    checkpoint.write(directory / "other_vocabulary.pt", payload)
    return directory / "other_vocabulary.pt"


def other_direction(teacher: Path, directory: Path) -> Path:
    payload = checkpoint.load(teacher)
    payload["train_config"]["data"].update(src_lang="en", tgt_lang="de")
    checkpoint.write(directory / "en_de.pt", payload)
    return directory / "en_de.pt"


def test_bad_teachers_stop_with_one_error_line_and_change_nothing(teacher, shared_corpus, tmp_path):
    cases = {
        "missing": ([f"teacher={tmp_path / 'missing.pt'}"], f"{tmp_path / 'missing.pt'} does not exist"),
        "direction": (
            [f"teacher={other_direction(teacher, tmp_path)}"],
            "translates en->de, but the student is to translate de->en",
        ),  # fmt: skip
        "vocabulary": (
            [f"teacher={teacher}", f"ensemble=[{another_vocabulary(teacher, tmp_path, shared_corpus)}]"],
            "has another tokenizer than",
        ),  # fmt: skip
        "no teacher": ([], "missing teacher=PATH"),
    }
    for name, (given, needle) in cases.items():
        before = files_of(tmp_path)
        args = ["distill.py", *given, f"data.dir={shared_corpus}", f"hydra.run.dir={tmp_path / 'run'}", *STUDENT]
        result = run(args)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and "Traceback" not in result.stderr, (name, result.stderr[-2000:])
        assert len(errors) == 1 and needle in errors[0], (name, result.stderr)
        assert files_of(tmp_path) == before, name


def test_an_empty_filtered_set_stops_with_one_error_line_and_keeps_the_translations(teacher, shared_corpus, tmp_path):
    run_dir = tmp_path / "run"
    args = [f"teacher={teacher}", f"data.dir={shared_corpus}", f"hydra.run.dir={run_dir}", *STUDENT]
    result = run(["distill.py", *args, "distill.max_length_ratio=1", "decode.max_len_a=0", "decode.max_len_b=2"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(errors) == 1 and "no distilled pair is left after filtering the 400 translations" in errors[0]
    assert (run_dir / "translate" / "manifest.json").is_file() and not (run_dir / "corpus").exists()
    assert len((run_dir / "translate" / "train.en").read_text().splitlines()) == 400


def test_distill_refuses_an_n_best_beyond_the_beam():
    from transformer.config import DistillRun

    with pytest.raises(ValueError, match="distill.n_best=3 needs decode.beam_size >= it"):
        DistillRun(teacher="t.pt", decode=DecodeConfig(beam_size=2), distill=DistillConfig(n_best=3))
    with pytest.raises(ValueError, match="distill.n_best=2 needs beam search"):
        DistillRun(teacher="t.pt", decode=DecodeConfig(strategy="greedy"), distill=DistillConfig(n_best=2))
