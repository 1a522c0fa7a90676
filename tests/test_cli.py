"""The entry points as a user runs them: an end-to-end smoke run, then bad input of every kind."""

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from . import forked
from .conftest import ROOT, write_corpus

pytestmark = pytest.mark.e2e  # every test runs train.py, translate.py, evaluate.py or a script


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python *args`, its own process forked from a warm interpreter (tests/forked.py)."""
    return forked.run(list(args), stdin=stdin, timeout=600)


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run("train.py", "experiment=smoke", f"hydra.run.dir={run_dir}", *overrides)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, shared_corpus) -> Path:
    """One `train.py experiment=smoke` run that the tests below inspect and reuse."""
    run_dir = tmp_path_factory.mktemp("smoke") / "run"
    # A fresh interpreter, as a user starts it: `python train.py ...` (the other commands are forked).
    args = ["train.py", "experiment=smoke", f"hydra.run.dir={run_dir}", f"data.dir={shared_corpus}", "data.vocab_size=300", "trainer.average_last=2"]  # fmt: skip
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir / "stdout.txt").write_text(result.stdout)
    return run_dir


def test_smoke_run_trains_and_reports_test_bleu(smoke_run):
    stdout = (smoke_run / "stdout.txt").read_text()
    for label in ("greedy", "beam5"):
        assert f"test_2016_flickr de-en {label}: BLEU" in stdout
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in stdout  # the sacreBLEU signature
    for name in (
        "checkpoint_best.pt",
        "checkpoint_last.pt",
        "checkpoint_20.pt",
        "spm.model",
        "train.log",
        "metrics.jsonl",
    ):
        assert (smoke_run / name).is_file(), name
    assert len((smoke_run / "test_2016_flickr.beam5.en").read_text().splitlines()) == 40
    results = json.loads((smoke_run / "results.json").read_text())
    assert results["steps"] == 20 and results["best_step"] in (10, 20)
    for key in ("test", "test_avg2"):  # the best checkpoint and the average of the last two
        assert set(results[key]) == {"test_2016_flickr/greedy", "test_2016_flickr/beam5"}
        assert "case:lc" in results[key]["test_2016_flickr/beam5"]["bleu_lc_signature"]
    assert results["average"]["checkpoints"] == ["checkpoint_10.pt", "checkpoint_20.pt"]
    assert (smoke_run / "checkpoint_avg2.pt").is_file() and (smoke_run / "test_2016_flickr.avg2.beam5.en").is_file()


def test_translate_reproduces_the_runs_hypotheses_from_the_checkpoint_alone(smoke_run, shared_corpus):
    sentences = gzip.decompress((shared_corpus / "test_2016_flickr.de.gz").read_bytes()).decode()
    translated = run(
        "translate.py", f"checkpoint={smoke_run / 'checkpoint_best.pt'}", "decode.max_len_b=5", stdin=sentences
    )
    assert translated.returncode == 0, translated.stderr
    assert translated.stdout.splitlines() == (smoke_run / "test_2016_flickr.beam5.en").read_text().splitlines()


def test_translate_keeps_empty_lines_and_writes_n_best_lists(smoke_run):
    best = smoke_run / "checkpoint_best.pt"
    translated = run("translate.py", f"checkpoint={best}", "decode.n_best=2", stdin="Ein Hund.\n\nZwei Katzen.\n")
    rows = [line.split("\t") for line in translated.stdout.splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "1", "1", "2", "2"] and rows[2][2] == rows[3][2] == ""
    one_best = run("translate.py", f"checkpoint={best}", "decode.strategy=greedy", stdin="Ein Hund.\n\n\nZwei.\n")
    assert len(one_best.stdout.splitlines()) == 4 and one_best.stdout.splitlines()[1:3] == ["", ""]


def test_translate_input_problems(smoke_run, tmp_path):
    best = smoke_run / "checkpoint_best.pt"
    long_line = " ".join(["Hund"] * 400)
    truncated = run("translate.py", f"checkpoint={best}", "decode.strategy=greedy", stdin=f"Ein Hund.\n{long_line}\n")
    assert truncated.returncode == 0 and len(truncated.stdout.splitlines()) == 2
    assert "stdin:2:" in truncated.stderr and "truncated to 255" in truncated.stderr
    empty = run("translate.py", f"checkpoint={best}", stdin="")
    assert empty.returncode == 0 and empty.stdout == "" and "has no lines" in empty.stderr
    latin1 = tmp_path / "latin1.de"
    latin1.write_bytes("Ein Hund.\nGr\u00fc\u00dfe\n".encode("latin-1"))
    assert_one_line_error(run("translate.py", f"checkpoint={best}", f"input={latin1}"), f"{latin1}:2", "UTF-8")


def test_evaluate_and_average_checkpoints(smoke_run, shared_corpus, tmp_path):
    best = smoke_run / "checkpoint_best.pt"
    evaluated = run(
        "evaluate.py",
        f"checkpoint={best}",
        f"data_dir={shared_corpus}",
        "decode.max_len_b=5",
        f"output={tmp_path / 'hyp'}",
    )
    assert evaluated.returncode == 0, evaluated.stderr
    assert "BLEU" in evaluated.stdout and "tok:13a" in evaluated.stdout and "chrF" in evaluated.stdout
    assert (tmp_path / "hyp").read_text() == (smoke_run / "test_2016_flickr.beam5.en").read_text()
    averaged = run("scripts/average_checkpoints.py", f"run={smoke_run}", "last=2", f"output={tmp_path / 'avg.pt'}")
    assert averaged.returncode == 0, averaged.stderr
    assert run("translate.py", f"checkpoint={tmp_path / 'avg.pt'}", stdin="Ein Hund.\n").returncode == 0


def test_evaluate_with_mbr_reranks_the_beams_hypotheses(smoke_run, shared_corpus, tmp_path):
    args = [f"checkpoint={smoke_run / 'checkpoint_best.pt'}", f"data_dir={shared_corpus}", "decode.max_len_b=5"]
    result = run("evaluate.py", *args, "decode.mbr=chrf", "decode.mbr_weights=uniform", f"output={tmp_path / 'mbr'}")
    assert result.returncode == 0, result.stderr
    assert "beam5-mbr-chrf: BLEU" in result.stdout and "tok:13a" in result.stdout
    beam = (smoke_run / "test_2016_flickr.beam5.en").read_text().splitlines()
    assert len((tmp_path / "mbr").read_text().splitlines()) == len(beam)


def test_tensorboard_events_hold_the_runs_scalars_texts_images_and_hparams(smoke_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(smoke_run / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    for name in ("train/loss", "train/ppl", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/padding_ratio",
                 "valid/loss", "valid/ppl", "valid/bleu", "valid/chrf"):  # fmt: skip
        assert name in tags["scalars"], name
    assert "valid/translations/text_summary" in tags["tensors"]
    for kind in ("encoder_self", "decoder_self", "cross"):
        assert f"attention/{kind}/layer0" in tags["images"]
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


def test_plot_attention_and_analyze_heads_write_pngs(smoke_run, shared_corpus, tmp_path):
    best = smoke_run / "checkpoint_best.pt"
    plotted = run(
        "scripts/plot_attention.py", f"checkpoint={best}", "sentence=Ein Hund rennt.", f"output_dir={tmp_path}"
    )
    assert plotted.returncode == 0, plotted.stderr
    pngs = sorted(tmp_path.glob("*.png"))
    assert [p.name for p in pngs] == ["cross_layer0.png", "decoder_self_layer0.png", "encoder_self_layer0.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    heads = run(
        "scripts/analyze_heads.py",
        f"checkpoint={best}",
        f"data_dir={shared_corpus}",
        "sentences=20",
        "prune=[2]",
        f"output={tmp_path / 'heads.png'}",
    )
    assert heads.returncode == 0, heads.stderr
    assert "pruning the 2 least important of 12 heads" in heads.stdout
    assert (
        len([line for line in heads.stdout.splitlines() if line.startswith(("encoder_self", "decoder_self", "cross"))])
        == 12
    )
    assert (tmp_path / "heads.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_config_key_fails_with_hydras_error(tmp_path):
    result = train(tmp_path / "run", "model.colour=blue")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "model.colour" in result.stderr


@pytest.mark.parametrize(
    "override, needles",
    [
        ("trainer.lr=fast", ["trainer.lr"]),
        ("model.n_kv_heads=3", ["model.n_kv_heads"]),
        ("model.dropout=1.5", ["model.dropout=1.5", "[0, 1)"]),
        ("data.src_lang=xx", ["unknown language code 'xx'", "train.xx"]),
    ],
)
def test_bad_values_give_one_error_line(tmp_path, tiny_corpus, override, needles):
    assert_one_line_error(train(tmp_path / "run", f"data.dir={tiny_corpus}", override), *needles)


def test_missing_data_directory(tmp_path):
    missing = tmp_path / "nowhere"
    assert_one_line_error(train(tmp_path / "run", f"data.dir={missing}"), str(missing))


def test_line_count_mismatch(tmp_path, tiny_corpus):
    write_corpus(tiny_corpus, "train", {"de": ["eins", "zwei", "drei"], "en": ["one", "two"]})
    assert_one_line_error(
        train(tmp_path / "run", f"data.dir={tiny_corpus}"), "train.de.gz has 3 lines", "train.en.gz has 2"
    )


def test_empty_training_set(tmp_path, tiny_corpus):
    write_corpus(tiny_corpus, "train", {"de": ["", ""], "en": ["", ""]})
    assert_one_line_error(train(tmp_path / "run", f"data.dir={tiny_corpus}"), "no non-empty sentence pairs")


def test_translate_refuses_a_file_that_is_not_a_checkpoint(tmp_path):
    bogus = tmp_path / "model.pt"
    bogus.write_text("hello\n")
    assert_one_line_error(run("translate.py", f"checkpoint={bogus}", stdin="Hallo\n"), str(bogus))
    assert_one_line_error(run("translate.py", "beam=5", stdin=""), "beam")


def bad_input_cases(run_dir: Path, tmp: Path) -> list[tuple[list[str], str, list[str]]]:
    """(arguments, stdin, expected words in the error line) for translate.py and evaluate.py."""
    import torch

    best = run_dir / "checkpoint_best.pt"
    truncated = tmp / "truncated.pt"
    truncated.write_bytes(best.read_bytes()[:5000])
    old_format = tmp / "old.pt"
    torch.save({"format_version": 0, "model": {}}, old_format)
    pickled = tmp / "pickled.pt"
    torch.save({"format_version": 1, "payload": Path("/")}, pickled)
    src, ref = tmp / "src.de", tmp / "ref.en"
    src.write_text("eins\nzwei\n")
    ref.write_text("one\n")
    return [
        (["translate.py", f"checkpoint={tmp / 'missing.pt'}"], "Hallo\n", ["missing.pt", "does not exist"]),
        (["translate.py", f"checkpoint={truncated}"], "Hallo\n", ["truncated.pt", "not a readable checkpoint"]),
        (["translate.py", f"checkpoint={old_format}"], "Hallo\n", ["old.pt", "format version 0"]),
        (["translate.py", f"checkpoint={pickled}"], "Hallo\n", ["pickled.pt", "was refused as unsafe"]),
        (["translate.py", f"checkpoint={best}", f"input={tmp / 'nothing.de'}"], "", ["nothing.de"]),
        (["translate.py", f"checkpoint={best}", "decode.beam_size=many"], "", ["decode.beam_size"]),
        (["translate.py", f"checkpoint={best}", "decode.strategy=best"], "", ["decode.strategy"]),
        (["translate.py", f"checkpoint={best}", "decode.strategy=greedy", "decode.mbr=chrf"], "", ["decode.mbr"]),
        (["evaluate.py", f"checkpoint={best}", f"src={src}", f"ref={ref}"], "", ["src.de has 2 lines", "ref.en has 1"]),
        (["evaluate.py", f"checkpoint={best}", f"src={src}"], "", ["ref=PATH"]),
        (["evaluate.py", f"checkpoint={best}", "split=test_2099"], "", ["test_2099"]),
        (["scripts/average_checkpoints.py", f"run={run_dir}", "last=9"], "", ["last=9", "2 numbered checkpoints"]),
        (["scripts/tune_decoding.py", f"checkpoint={best}", "metric=ter"], "", ["metric='ter'"]),
        (["scripts/tune_decoding.py", f"checkpoint={best}", "beam_sizes=[0,5]"], "", ["beam_sizes=[0, 5]"]),
    ]


def test_bad_inputs_to_translate_evaluate_and_average_get_one_error_line(smoke_run, tmp_path):
    for args, stdin, needles in bad_input_cases(smoke_run, tmp_path):
        assert_one_line_error(run(*args, stdin=stdin), *needles)


def test_plot_curves_draws_the_validation_curve_of_a_run(smoke_run, tmp_path):
    result = run("scripts/plot_curves.py", f"runs=[{smoke_run}]", f"output={tmp_path / 'curves.png'}")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert_one_line_error(run("scripts/plot_curves.py", f"runs=[{tmp_path}]"), "no metrics.jsonl")


def test_convert_to_gqa_converts_finetunes_and_reports(smoke_run, tmp_path):
    output = tmp_path / "gqa2.pt"
    result = run(
        "scripts/convert_to_gqa.py",
        f"checkpoint={smoke_run / 'checkpoint_best.pt'}",
        "n_kv_heads=2",
        "finetune_steps=4",
        "splits=[val]",
        "decode.strategy=greedy",
        "decode.max_len_b=5",
        f"output={output}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(output.with_suffix(".json").read_text())
    for key in ("bleu_before", "bleu_converted", "bleu_finetuned"):
        assert set(report[key]) == {"val"}
    before, after = report["kv_cache_bytes_before"], report["kv_cache_bytes_after"]
    assert after["self_per_target_token"] * 2 == before["self_per_target_token"]
    evaluated = run("evaluate.py", f"checkpoint={output}", "split=val", "decode.strategy=greedy", "decode.max_len_b=5")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    bad = run("scripts/convert_to_gqa.py", f"checkpoint={smoke_run / 'checkpoint_best.pt'}", "n_kv_heads=3")
    assert_one_line_error(bad, "model.n_heads=4 is not divisible by model.n_kv_heads=3")


def test_train_with_mixture_of_head_attention_logs_its_balance_loss(tmp_path, shared_corpus):
    run_dir = tmp_path / "moh"
    result = train(run_dir, f"data.dir={shared_corpus}", "data.vocab_size=300", "model/attention=moh", "trainer.max_steps=10", "trainer.eval_every=10")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    balance = [r["balance_loss"] for r in records if "balance_loss" in r]
    assert balance and all(b >= 0.01 for b in balance)  # beta * (>= 1 per module)
    assert any("train_minutes" in r for r in records)


def test_train_streaming_from_memory_mapped_arrow_files(tmp_path, shared_corpus):
    run_dir = tmp_path / "streamed"
    result = train(run_dir, f"data.dir={shared_corpus}", "data.vocab_size=300", "data.streaming=true", "trainer.max_steps=10", "trainer.eval_every=10")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "400 training pairs" in (run_dir / "train.log").read_text()
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 10


def test_evaluate_budgets_scores_the_run_as_if_stopped_at_each_budget(smoke_run):
    result = run("scripts/lab/evaluate_budgets.py", f"run={smoke_run}", "minutes=[0.0001,100]", "average=2")
    assert result.returncode != 0 and "no validation within 0.0001 minutes" in result.stderr
    result = run(
        "scripts/lab/evaluate_budgets.py",
        f"run={smoke_run}",
        "minutes=[100]",
        "average=2",
        "splits=[val,test_2016_flickr]",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    budgets = json.loads((smoke_run / "budgets.json").read_text())
    assert budgets["100/avg2"]["checkpoints"] == ["checkpoint_10.pt", "checkpoint_20.pt"]
    assert budgets["100/best"]["last_step"] == 20 and "test_2016_flickr/beam5" in budgets["100/best"]["test"]


def test_tune_decoding_scores_every_pair_like_evaluate_and_names_the_best(smoke_run, tmp_path):
    best, output = smoke_run / "checkpoint_best.pt", tmp_path / "tuned.json"
    grid = ["beam_sizes=[2,1]", "length_penalties=[0.0,1.0]", "decode.max_len_b=5"]
    result = run("scripts/tune_decoding.py", f"checkpoint={best}", *grid, f"output={output}")
    assert result.returncode == 0, result.stderr[-2000:]
    tuned = json.loads(output.read_text())
    rows = tuned["results"]
    assert [(r["beam_size"], r["length_penalty"]) for r in rows] == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
    assert tuned["best"] == max(rows, key=lambda r: r["bleu"]) and "split" not in tuned
    assert tuned["source"].endswith("val.de.gz") and "tok:13a" in tuned["signatures"]["bleu"]
    chosen = tuned["best"]
    assert (
        f"best: decode.beam_size={chosen['beam_size']} decode.length_penalty={chosen['length_penalty']:g}"
        in result.stdout
    )
    evaluated = run(
        "evaluate.py", f"checkpoint={best}", "split=val", "decode.max_len_b=5", "decode.beam_size=2",
        "decode.length_penalty=1.0", f"output={tmp_path / 'hyp'}",
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert f"BLEU {rows[3]['bleu']:.2f} (" in evaluated.stdout  # the same decoding, scored the same way


def test_results_table_prints_every_score_with_signatures(smoke_run):
    result = run("scripts/lab/results_table.py", f"run={smoke_run}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        "| best checkpoint (step" in result.stdout
        and "| average of 2 checkpoints | test_2016_flickr | beam5 |" in result.stdout
    )
    assert "case:lc" in result.stdout and "nrefs:1|case:mixed" in result.stdout


def test_attention_lab_trains_converts_and_writes_the_table(shared_corpus, tmp_path):
    doc = tmp_path / "ATTENTION.md"
    doc.write_text("intro\n<!-- attention-lab:start -->\nold\n<!-- attention-lab:end -->\nrest\n")
    # The shortest runs that still validate with BLEU, keep a best checkpoint and score the test split.
    extra = f"extra=['experiment=smoke','data.dir={shared_corpus}','data.vocab_size=300','trainer.max_steps=10','trainer.attention_images=false']"
    args = ["only=[mha,moh]", "minutes=5", "finetune_steps=2", "speed_sentences=5", f"out={tmp_path / 'lab'}", f"doc={doc}"]  # fmt: skip
    result = run("scripts/lab/attention_lab.py", extra, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("rest\n") and "old" not in text
    assert "| mha: standard multi-head attention |" in text and "| moh: MoH" in text
    assert "| mha_to_mqa_aligned_ft, 2 steps |" in text
    summary = json.loads((tmp_path / "lab" / "summary.json").read_text())
    moh = next(r for r in summary["rows"] if r["variant"] == "moh")
    mha = next(r for r in summary["rows"] if r["variant"] == "mha")
    assert moh["parameters"] > mha["parameters"] and moh["kv_bytes_per_token"] == mha["kv_bytes_per_token"]
    assert summary["conversions"]["mha_to_mqa_aligned_ft"]["kv_cache_bytes_after"]["self_per_target_token"] * 4 == mha["kv_bytes_per_token"]  # fmt: skip


def test_train_with_rdrop(tmp_path, shared_corpus):
    run_dir = tmp_path / "rdrop"
    result = train(run_dir, f"data.dir={shared_corpus}", "data.vocab_size=300", "trainer.rdrop=1.0", "trainer.max_steps=4", "trainer.eval_every=4", "trainer.log_every=1", "data.test_splits=[]")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]  # fmt: skip
    assert losses and all(math.isfinite(x) for x in losses)
