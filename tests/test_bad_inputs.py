"""Hostile inputs to every entry point that reads a checkpoint or writes a file: each gets one
`error:` line naming the key or path at fault, no traceback, and leaves every file it was given
byte for byte as it was. Then the legitimate paths beside them still work."""

import copy
import hashlib
import importlib.util
import io
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from transformer import checkpoint

from . import forked
from .conftest import ROOT

pytestmark = pytest.mark.e2e  # every test reads the checkpoints of a train.py run

SCRIPTS = {}  # path relative to the repository -> its module, imported once


def entry_point(script: str):
    """The module of translate.py, evaluate.py or scripts/NAME.py, for calling its main(argv)."""
    if script not in SCRIPTS:
        name = "entry_" + script.replace("/", "_").removesuffix(".py")
        spec = importlib.util.spec_from_file_location(name, ROOT / script)
        module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(module)
        SCRIPTS[script] = module
    return SCRIPTS[script]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_corpus) -> Path:
    """A tiny de->en run: checkpoint_best.pt and one numbered checkpoint."""
    run_dir = tmp_path_factory.mktemp("bad_inputs") / "run"
    args = ["train.py", "experiment=smoke", f"hydra.run.dir={run_dir}", f"data.dir={shared_corpus}",
            "data.vocab_size=300", "trainer.max_steps=4", "trainer.eval_every=4", "data.test_splits=[]",
            "trainer.attention_images=false"]  # fmt: skip
    result = forked.run(args, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def edited(payload: dict, edit) -> dict:
    copied = copy.deepcopy(payload)
    edit(copied)
    return copied


def damaged_payloads(best: dict) -> dict[str, dict]:
    """Checkpoints that torch.load(weights_only=True) reads, each wrong in one way."""
    weight = "encoder_layers.0.self_attn.w_q.weight"

    def set_pair(src: str, tgt: str, extra=()):
        return lambda p: p["train_config"]["data"].update(src_lang=src, tgt_lang=tgt, extra_src_langs=list(extra))

    return {
        "ende.pt": edited(best, set_pair("en", "de")),
        "many.pt": edited(best, set_pair("de", "en", ["fr"])),
        "no_train_config.pt": edited(best, lambda p: p.pop("train_config")),
        "no_model_config.pt": edited(best, lambda p: p.pop("model_config")),
        "no_model.pt": edited(best, lambda p: p.pop("model")),
        "no_tokenizer.pt": edited(best, lambda p: p.pop("tokenizer")),
        "unknown_key.pt": edited(best, lambda p: p["model_config"].update(colour="blue")),
        "bad_value.pt": edited(best, lambda p: p["model_config"].update(n_heads=3)),
        "wrong_type.pt": edited(best, lambda p: p["model_config"].update(d_model="big")),
        "missing_weight.pt": edited(best, lambda p: p["model"].pop(weight)),
        "extra_weight.pt": edited(best, lambda p: p["model"].update(surplus=torch.zeros(2))),
        "wrong_shape.pt": edited(best, lambda p: p["model"].update({weight: torch.zeros(32, 16)})),
        "garbage_tokenizer.pt": edited(best, lambda p: p.update(tokenizer=checkpoint.as_tensor(b"not a model"))),
        "empty_tokenizer.pt": edited(best, lambda p: p.update(tokenizer=torch.zeros(0, dtype=torch.uint8))),
    }


@pytest.fixture(scope="module")
def blobs(trained, tmp_path_factory) -> dict[str, bytes]:
    """File name -> bytes of every checkpoint the cases start with."""
    out = tmp_path_factory.mktemp("blobs")
    best = checkpoint.load(trained / "checkpoint_best.pt")
    for name, payload in damaged_payloads(best).items():
        checkpoint.write(out / name, payload)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    files["model.pt"] = (trained / "checkpoint_best.pt").read_bytes()
    files["other.pt"] = (trained / "checkpoint_4.pt").read_bytes()
    return files


DIR = object()  # a file spec that makes a directory


class RunsCode:
    """Unpickled, this would call os.system: what a checkpoint that runs code when loaded holds."""

    def __reduce__(self):
        return os.system, ("echo this checkpoint ran code",)


def saved(payload) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


METRICS = b'{"step": 4, "valid_loss": 5.0, "valid_bleu": 0.1, "train_minutes": 0.1}\n'
SRC, REF = b"Ein Hund.\nZwei Katzen.\n", b"A dog.\nTwo cats.\n"
TEXT = {"in.de": SRC, "src.de": SRC, "ref.en": REF}


@dataclass
class Case:
    script: str
    args: str  # {d}: the case's directory, {corpus}: the shared de-en corpus
    needle: str  # what the error line must contain, formatted like args
    files: dict = field(default_factory=dict)  # name -> bytes, a blob's name, DIR, or ("link", target)
    stdin: bytes = b""


T, E, A = "translate.py", "evaluate.py", "scripts/average_checkpoints.py"
CKPT, SCORE = "checkpoint={d}/model.pt", "checkpoint={d}/model.pt src={d}/src.de ref={d}/ref.en"
CASES = [
    # 1. an output that is an input or an existing checkpoint
    Case(T, f"{CKPT} input={{d}}/in.de output={{d}}/in.de", "output={d}/in.de is one of the inputs"),
    Case(T, f"{CKPT} input={{d}}/in.de output={{d}}/link.en", "output={d}/link.en is one of the inputs", {"link.en": ("link", "in.de")}),  # fmt: skip
    Case(T, f"{CKPT} input={{d}}/in.de output={{d}}/model.pt", "output={d}/model.pt is an existing checkpoint"),
    Case(T, f"{CKPT} input={{d}}/in.de output={{d}}/weights.bin", "output={d}/weights.bin is an existing checkpoint", {"weights.bin": "other.pt"}),  # fmt: skip
    Case(T, f"{CKPT} ensemble=[{{d}}/other.pt] input={{d}}/in.de output={{d}}/other.pt", "output={d}/other.pt"),
    Case(E, f"{SCORE} output={{d}}/ref.en", "output={d}/ref.en is one of the inputs"),
    Case(E, f"{SCORE} output={{d}}/src.de", "output={d}/src.de is one of the inputs"),
    Case(E, f"{SCORE} output={{d}}/model.pt", "output={d}/model.pt is an existing checkpoint"),
    Case(A, "inputs=[{d}/model.pt,{d}/other.pt] output={d}/other.pt", "output={d}/other.pt"),
    Case(A, "inputs=[{d}/model.pt] output={d}/ende.pt", "output={d}/ende.pt is an existing checkpoint"),
    Case("scripts/convert_to_gqa.py", f"{CKPT} output={{d}}/model.pt", "output={d}/model.pt"),
    Case("scripts/convert_to_gqa.py", f"{CKPT} output={{d}}/gqa.pt results={{d}}/other.pt", "results={d}/other.pt"),
    Case("scripts/tune_decoding.py", f"{SCORE} output={{d}}/ref.en", "output={d}/ref.en is one of the inputs"),
    Case("scripts/plot_curves.py", "runs=[{d}/run] output={d}/run/metrics.jsonl", "output={d}/run/metrics.jsonl", {"run/metrics.jsonl": METRICS}),  # fmt: skip
    Case("scripts/analyze_heads.py", f"{CKPT} data_dir={{corpus}} output={{d}}/other.pt", "output={d}/other.pt is an existing checkpoint"),  # fmt: skip
    Case("benchmarks/benchmark_decoding.py", f"{CKPT} output={{d}}/model.pt", "output={d}/model.pt"),
    Case("benchmarks/benchmark.py", "output={d}/model.pt", "output={d}/model.pt is an existing checkpoint"),
    Case("scripts/plot_attention.py", f"{CKPT} sentence=Hund output_dir={{d}}/in.de", "output_dir={d}/in.de is not a directory"),  # fmt: skip
    Case("scripts/lab/evaluate_budgets.py", "run={d}/run", "{d}/run/budgets.json is an existing checkpoint", {"run/metrics.jsonl": METRICS, "run/checkpoint_4.pt": "other.pt", "run/budgets.json": "model.pt"}),  # fmt: skip
    # 2. an output in a directory that does not exist, or that is a directory
    Case(T, f"{CKPT} input={{d}}/in.de output={{d}}/missing/out.en", "the directory {d}/missing does not exist"),
    Case(T, f"{CKPT} input={{d}}/in.de output={{d}}/adir", "output={d}/adir is a directory", {"adir": DIR}),
    Case(E, f"{SCORE} output={{d}}/missing/x.hyp", "the directory {d}/missing does not exist"),
    Case(A, "inputs=[{d}/model.pt] output={d}/nonexistent/dir/x.pt", "the directory {d}/nonexistent/dir does not exist"),
    Case("scripts/convert_to_gqa.py", f"{CKPT} output={{d}}/missing/x.pt", "the directory {d}/missing does not exist"),
    Case("scripts/tune_decoding.py", f"{SCORE} output={{d}}/missing/x.json", "the directory {d}/missing"),
    Case("scripts/plot_curves.py", "runs=[{d}/run] output={d}/missing/c.png", "the directory {d}/missing", {"run/metrics.jsonl": METRICS}),  # fmt: skip
    Case("scripts/analyze_heads.py", f"{CKPT} data_dir={{corpus}} output={{d}}/missing/h.png", "the directory {d}/missing"),
    Case("benchmarks/benchmark_decoding.py", f"{CKPT} output={{d}}/missing/b.json", "the directory {d}/missing"),
    Case("benchmarks/benchmark.py", "output={d}/missing/b.json", "the directory {d}/missing does not exist"),
    # 3. input and output failures of the operating system
    Case(T, f"{CKPT} input={{d}}/in.de output=/dev/full", "cannot write /dev/full: No space left on device"),
    Case(T, f"{CKPT} input={{d}}/adir", "cannot read {d}/adir", {"adir": DIR}),
    Case(E, f"{CKPT} src={{d}}/src.de ref={{d}}/adir.en", "cannot read {d}/adir.en", {"adir.en": DIR}),
    # 4. checkpoints that the safe loader refuses, or reads but that cannot be used
    Case(T, "checkpoint={d}/adir", "{d}/adir is a directory, not a checkpoint file", {"adir": DIR}),
    Case(T, "checkpoint={d}/missing.pt", "{d}/missing.pt does not exist"),
    Case(T, "checkpoint={d}/no_model_config.pt", "{d}/no_model_config.pt is damaged: it has no 'model_config'"),
    Case(T, "checkpoint={d}/no_model.pt", "{d}/no_model.pt is damaged: it has no 'model'"),
    Case(T, "checkpoint={d}/no_tokenizer.pt", "{d}/no_tokenizer.pt is damaged: it has no 'tokenizer'"),
    Case(T, "checkpoint={d}/unknown_key.pt", "{d}/unknown_key.pt has a bad model_config"),
    Case(T, "checkpoint={d}/bad_value.pt", "{d}/bad_value.pt has a bad model_config"),
    Case(T, "checkpoint={d}/wrong_type.pt", "{d}/wrong_type.pt has a bad model_config"),
    Case(T, "checkpoint={d}/missing_weight.pt", "{d}/missing_weight.pt: its weights do not fit"),
    Case(T, "checkpoint={d}/extra_weight.pt", "{d}/extra_weight.pt: its weights do not fit"),
    Case(T, "checkpoint={d}/wrong_shape.pt", "{d}/wrong_shape.pt: its weights do not fit"),
    Case(T, "checkpoint={d}/garbage_tokenizer.pt", "{d}/garbage_tokenizer.pt: its tokenizer is damaged"),
    Case(T, "checkpoint={d}/empty_tokenizer.pt", "{d}/empty_tokenizer.pt: its tokenizer is damaged"),
    Case(E, f"{SCORE} ensemble=[{{d}}/no_tokenizer.pt]", "{d}/no_tokenizer.pt"),
    Case(A, "inputs=[{d}/no_model.pt,{d}/model.pt] output={d}/avg.pt", "{d}/no_model.pt is damaged"),
    Case(A, "inputs=[{d}/wrong_shape.pt,{d}/model.pt] output={d}/avg.pt", "{d}/wrong_shape.pt has other weights"),
    Case("scripts/tune_decoding.py", "checkpoint={d}/no_model.pt src={d}/src.de ref={d}/ref.en", "{d}/no_model.pt"),
    Case("scripts/plot_attention.py", "checkpoint={d}/garbage_tokenizer.pt sentence=Hund output_dir={d}/att", "{d}/garbage_tokenizer.pt"),  # fmt: skip
    Case("scripts/analyze_heads.py", "checkpoint={d}/no_train_config.pt", "{d}/no_train_config.pt has no train_config"),
    Case("scripts/convert_to_gqa.py", "checkpoint={d}/no_train_config.pt", "{d}/no_train_config.pt has no train_config"),
    Case("benchmarks/benchmark_decoding.py", "checkpoint={d}/adir", "{d}/adir is a directory", {"adir": DIR}),
    Case(T, "checkpoint={d}/code.pt", "{d}/code.pt was refused as unsafe", {"code.pt": saved({"format_version": 1, "x": RunsCode()})}, stdin=SRC),  # fmt: skip
    # 5. bytes on standard input that are not UTF-8
    Case(T, CKPT, "standard input:2: line is not valid UTF-8", stdin=b"Ein Hund.\n\xff\xfe\n"),
    Case(T, CKPT, "standard input:1: line is not valid UTF-8", stdin="Grüße\n".encode("latin-1")),
    # 6. a checkpoint's language pair
    Case(T, f"{CKPT} ensemble=[{{d}}/ende.pt]", "ensemble checkpoint {d}/ende.pt translates en->de, but {d}/model.pt translates de->en"),  # fmt: skip
    Case(A, "inputs=[{d}/ende.pt,{d}/model.pt] output={d}/avg.pt", "{d}/ende.pt translates en->de"),
    Case(E, f"{CKPT} split=val data_dir={{corpus}} src_lang=en tgt_lang=de", "src_lang=en"),
    Case(E, f"{CKPT} split=val data_dir={{corpus}} tgt_lang=de", "tgt_lang=de"),
    Case(E, f"{CKPT} src={{d}}/ref.en ref={{d}}/ref2.en", "src={d}/ref.en is in en", {"ref2.en": REF}),
    Case(E, f"{CKPT} src={{d}}/src.de ref={{d}}/src2.de.gz", "ref={d}/src2.de.gz is in de", {"src2.de.gz": b""}),
    Case(E, "checkpoint={d}/ende.pt src={d}/src.de ref={d}/ref.en", "src={d}/src.de is in de, but {d}/ende.pt translates en->de"),  # fmt: skip
    Case("scripts/tune_decoding.py", f"{SCORE} ensemble=[{{d}}/ende.pt]", "{d}/ende.pt translates en->de"),
    Case("scripts/tune_decoding.py", f"{CKPT} data_dir={{corpus}} src_lang=en", "src_lang=en"),
    # 7. target prefixes (source<TAB>prefix) and a system to compare with
    Case(T, f"{CKPT} prefix=true input={{d}}/in.de", "{d}/in.de:1: expected source<TAB>prefix, found 0 TABs"),
    Case(T, f"{CKPT} prefix=true", "stdin:2: expected source<TAB>prefix, found 2 TABs", stdin=b"Ein Hund.\tA\nZwei.\tTwo\tcats\n"),  # fmt: skip
    Case(T, f"{CKPT} prefix=true", "stdin:1: the prefix has", stdin=("Ein Hund.\t" + "dog " * 300 + "\n").encode()),
    Case(T, f"{CKPT} prefixes=true", "prefixes"),
    Case(E, f"{SCORE} compare={{d}}/short.en", "line counts differ: {d}/short.en has 1 lines, {d}/ref.en has 2", {"short.en": b"A dog.\n"}),  # fmt: skip
    Case(E, f"{SCORE} compare={{d}}/missing.en", "cannot read {d}/missing.en"),
    Case(E, f"{SCORE} compare={{d}}/ref.en compare_seed=0", "compare_seed=0 must be >= 1"),
    Case(E, f"{SCORE} compare={{d}}/ref.en output={{d}}/ref.en", "output={d}/ref.en is one of the inputs"),
    Case(T, f"{CKPT} decode.alignment=true decode.alignment_layer=3", "decode.alignment_layer=3, but the decoder has", stdin=SRC),  # fmt: skip
    Case(T, f"{CKPT} constraints=true", "stdin:2: expected source<TAB>phrase<TAB>..., found an empty phrase", stdin=b"Ein Hund.\tdog\nZwei.\t\tcats\n"),  # fmt: skip
    Case(T, f"{CKPT} constraints=true decode.strategy=greedy", "constraints need decode.strategy=beam", stdin=b"Ein Hund.\tdog\n"),  # fmt: skip
    Case(T, f"{CKPT} constraints=true prefix=true", "prefix=true and constraints=true"),
    Case("scripts/compare_systems.py", "baseline={d}/ref.en system={d}/short.en ref={d}/ref.en", "line counts differ: {d}/short.en has 1 lines, {d}/ref.en has 2", {"short.en": b"A dog.\n"}),  # fmt: skip
    Case("scripts/compare_systems.py", "baseline={d}/ref.en system={d}/ref.en", "missing ref=... (see --help)"),
    Case("scripts/compare_systems.py", "baseline={d}/ref.en system={d}/ref.en ref={d}/ref.en seed=0", "seed=0 must be >= 1"),  # fmt: skip
    # 8. a lexical shortlist that is missing, damaged or asked of the wrong command
    Case(T, f"{CKPT} decode.shortlist=true", "decode.shortlist=true needs a shortlist beside the checkpoint ({d}/shortlist.tsv does not exist)", stdin=SRC),  # fmt: skip
    Case(E, f"{SCORE} decode.shortlist=true", "{d}/shortlist.tsv, line 1: not `source piece<TAB>target pieces`", {"shortlist.tsv": b"garbage\n"}),  # fmt: skip
    Case(T, f"{CKPT} decode.shortlist=true", "{d}/shortlist.tsv, line 2: piece '▁Zyzzyva' is not in the model's vocabulary", {"shortlist.tsv": "\t.\n▁Zyzzyva\t.\n".encode()}, stdin=SRC),  # fmt: skip
    Case("scripts/build_shortlist.py", f"{CKPT} source={{d}}/src.de", "give both source= and target=, or neither"),
    Case("scripts/build_shortlist.py", f"{CKPT} output={{d}}/ref.en", "output={d}/ref.en exists: give overwrite=true to replace it"),  # fmt: skip
    Case("scripts/build_shortlist.py", f"{CKPT} output={{d}}/model.pt overwrite=true", "output={d}/model.pt is an existing checkpoint"),  # fmt: skip
    Case("scripts/build_shortlist.py", f"{CKPT} source={{d}}/src.de target={{d}}/short.en", "line counts differ", {"short.en": b"A dog.\n"}),  # fmt: skip
    Case("scripts/build_shortlist.py", "checkpoint={d}/no_train_config.pt", "{d}/no_train_config.pt does not say what it was trained on"),  # fmt: skip
    # 9. options the chosen mode has no use for: refused, not ignored (even at their default value)
    Case(T, f"{CKPT} scheduler=continuous chunk_lines=2000", "it cannot be used with chunk_lines=", stdin=SRC),
    Case(E, f"{CKPT} all_directions=true compare={{d}}/ref.en", "it cannot be used with compare="),
    Case(E, f"{CKPT} all_directions=true output={{d}}/out.hyp", "it cannot be used with output="),
    Case(E, f"{SCORE} all_directions=true", "it cannot be used with src="),
    Case(E, f"{CKPT} all_directions=true ref={{d}}/ref.en", "it cannot be used with ref="),
    Case(E, f"{CKPT} all_directions=true src_lang=de", "it cannot be used with src_lang="),
    Case(E, f"{CKPT} all_directions=true tgt_lang=en", "it cannot be used with tgt_lang="),
]  # fmt: skip


def make_files(directory: Path, specs: dict, blobs: dict[str, bytes]) -> None:
    for name, spec in {**TEXT, **dict.fromkeys(("model.pt", "other.pt", "ende.pt")), **specs}.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if spec is DIR:
            path.mkdir()
        elif isinstance(spec, tuple):
            path.symlink_to(spec[1])
        elif isinstance(spec, bytes):
            path.write_bytes(spec)
        else:
            path.write_bytes(blobs[spec or name])


def snapshot(*directories: Path) -> dict[Path, str]:
    """Every file under the directories (through symlinks) -> the SHA-256 of its bytes."""
    files = [p for d in directories for p in sorted(d.rglob("*")) if p.is_file()]
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def run_main(script: str, argv: list[str], stdin: bytes, monkeypatch) -> int:
    """The exit status of the script's main(argv), run in this process."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    try:
        entry_point(script).main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


def case_needs(case: Case, blobs: dict[str, bytes]) -> dict:
    """The files of a case: its own, plus the damaged checkpoint it names."""
    return {name: None for name in re.findall(r"/(\w+\.pt)\b", case.args) if name in blobs} | case.files


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c.script.split('/')[-1]}" for i, c in enumerate(CASES)])
def test_bad_input_gets_one_error_line_and_changes_no_file(case, blobs, shared_corpus, tmp_path, capsys, monkeypatch):
    if "/dev/full" in case.args and not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    make_files(tmp_path, case_needs(case, blobs), blobs)
    before = snapshot(tmp_path, shared_corpus)
    argv = case.args.format(d=tmp_path, corpus=shared_corpus).split()
    status = run_main(case.script, argv, case.stdin, monkeypatch)
    out, err = capsys.readouterr()
    assert status != 0, out + err
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert case.needle.format(d=tmp_path, corpus=shared_corpus) in errors[0]
    assert snapshot(tmp_path, shared_corpus) == before  # nothing changed, nothing new, no temporary file


# --- The legitimate paths still work ------------------------------------------------------------


def test_translate_writes_a_new_output_atomically_and_through_a_symlink(blobs, tmp_path, monkeypatch):
    make_files(tmp_path, {"old.en": b"keep me\n", "link.en": ("link", "old.en")}, blobs)
    args = [f"checkpoint={tmp_path / 'model.pt'}", f"input={tmp_path / 'in.de'}", "decode.strategy=greedy", "decode.max_len_b=3"]  # fmt: skip
    assert run_main(T, [*args, f"output={tmp_path / 'out.en'}"], b"", monkeypatch) == 0
    assert len((tmp_path / "out.en").read_text().splitlines()) == 2
    assert run_main(T, [*args, f"output={tmp_path / 'link.en'}"], b"", monkeypatch) == 0
    assert (tmp_path / "link.en").is_symlink()
    assert (tmp_path / "old.en").read_text() == (tmp_path / "out.en").read_text()
    assert (tmp_path / "in.de").read_bytes() == SRC
    assert not list(tmp_path.glob(".*.tmp"))


def test_translate_reads_utf8_and_crlf_from_stdin(blobs, tmp_path, monkeypatch, capsys):
    make_files(tmp_path, {}, blobs)
    args = [f"checkpoint={tmp_path / 'model.pt'}", "decode.strategy=greedy", "decode.max_len_b=3"]
    assert run_main(T, args, "Grüße.\r\n\r\nEin Hund.\r\n".encode(), monkeypatch) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_a_normal_ensemble_and_a_many_to_one_member_still_load(blobs, tmp_path, monkeypatch, capsys):
    make_files(tmp_path, {"many.pt": None}, blobs)
    ensemble = f"ensemble=[{tmp_path / 'other.pt'},{tmp_path / 'many.pt'}]"
    args = [f"checkpoint={tmp_path / 'model.pt'}", ensemble, "decode.strategy=greedy", "decode.max_len_b=3"]
    assert run_main(T, args, SRC, monkeypatch) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_evaluate_and_average_write_new_outputs(blobs, tmp_path, monkeypatch, capsys):
    make_files(tmp_path, {}, blobs)
    hyp, avg = tmp_path / "out.hyp", tmp_path / "avg.pt"
    score = [f"checkpoint={tmp_path / 'model.pt'}", f"src={tmp_path / 'src.de'}", f"ref={tmp_path / 'ref.en'}"]
    assert run_main(E, [*score, "decode.strategy=greedy", "decode.max_len_b=3", f"output={hyp}"], b"", monkeypatch) == 0
    assert "BLEU" in capsys.readouterr().out and len(hyp.read_text().splitlines()) == 2
    assert run_main(A, [f"inputs=[{tmp_path / 'model.pt'},{tmp_path / 'other.pt'}]", f"output={avg}"], b"", monkeypatch) == 0  # fmt: skip
    assert checkpoint.load(avg)["averaged_from"] == [str(tmp_path / "model.pt"), str(tmp_path / "other.pt")]
    assert not list(tmp_path.glob(".*.tmp"))


def test_translate_starts_each_translation_with_its_prefix(blobs, tmp_path, monkeypatch, capsys):
    make_files(tmp_path, {}, blobs)
    args = [f"checkpoint={tmp_path / 'model.pt'}", "prefix=true", "decode.max_len_b=3"]
    assert run_main(T, args, b"Ein Hund.\tA black\n\nZwei Katzen.\tTwo cats are\n", monkeypatch) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0].startswith("A black") and out[1] == "" and out[2].startswith("Two cats are")


def test_translate_prints_one_word_link_per_translated_word(blobs, tmp_path, monkeypatch, capsys):
    make_files(tmp_path, {}, blobs)
    args = [f"checkpoint={tmp_path / 'model.pt'}", "decode.alignment=true", "decode.alignment_layer=-1", "decode.max_len_b=4"]  # fmt: skip
    assert run_main(T, args, SRC, monkeypatch) == 0
    for line in capsys.readouterr().out.splitlines():
        text, links = line.split("\t")
        assert sorted(int(pair.split("-")[1]) for pair in links.split()) == list(range(len(text.split())))


def test_translate_places_the_constraints_in_each_translation(blobs, tmp_path, monkeypatch, capsys):
    make_files(tmp_path, {}, blobs)
    args = [f"checkpoint={tmp_path / 'model.pt'}", "constraints=true", "decode.beam_size=3", "decode.max_len_b=4"]
    assert run_main(T, args, b"Ein Hund.\tblack dog\tstreet\nZwei Katzen.\n", monkeypatch) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "black dog" in out[0] and "street" in out[0]


def test_compare_systems_tests_two_hypothesis_files(blobs, tmp_path, monkeypatch, capsys):
    make_files(tmp_path, {"worse.en": b"A cat.\nTwo dogs.\n"}, blobs)
    args = [f"baseline={tmp_path / 'worse.en'}", f"system={tmp_path / 'ref.en'}", f"ref={tmp_path / 'ref.en'}"]
    assert run_main("scripts/compare_systems.py", args, b"", monkeypatch) == 0
    out = capsys.readouterr().out
    assert "chrF2: baseline" in out and ", system 100.00, difference +" in out


def test_evaluate_compares_its_translations_with_another_system(blobs, tmp_path, monkeypatch, capsys):
    make_files(tmp_path, {}, blobs)
    score = [f"checkpoint={tmp_path / 'model.pt'}", f"src={tmp_path / 'src.de'}", f"ref={tmp_path / 'ref.en'}"]
    args = [*score, "decode.strategy=greedy", "decode.max_len_b=3", f"output={tmp_path / 'h'}", f"compare={tmp_path / 'ref.en'}"]  # fmt: skip
    assert run_main(E, args, b"", monkeypatch) == 0
    out = capsys.readouterr().out
    assert "BLEU: baseline" in out and "chrF2: baseline 100.00" in out and "approximate randomization" in out


def test_checkpoints_without_a_train_config_still_translate_and_evaluate(blobs, tmp_path, monkeypatch, capsys):
    make_files(tmp_path, {"no_train_config.pt": None, "x.en": SRC, "y.de": REF}, blobs)
    plain = f"checkpoint={tmp_path / 'no_train_config.pt'}"
    quick = ["decode.strategy=greedy", "decode.max_len_b=3"]
    assert run_main(T, [plain, *quick, f"input={tmp_path / 'x.en'}"], b"", monkeypatch) == 0
    files = [f"src={tmp_path / 'x.en'}", f"ref={tmp_path / 'y.de'}", f"output={tmp_path / 'h'}"]
    assert run_main(E, [plain, *quick, *files], b"", monkeypatch) == 0  # no language pair to contradict


def test_translate_warns_when_the_input_is_named_in_the_target_language(blobs, tmp_path, monkeypatch, caplog):
    make_files(tmp_path, {"x.en": SRC}, blobs)
    args = [f"checkpoint={tmp_path / 'model.pt'}", f"input={tmp_path / 'x.en'}", "decode.strategy=greedy", "decode.max_len_b=3"]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert run_main(T, args, b"", monkeypatch) == 0
    assert any("input=" in r.message and "translates into (de->en)" in r.message for r in caplog.records)


def test_the_checkpoint_check_judges_by_content_not_name(blobs, tmp_path):
    from transformer.files import is_checkpoint

    make_files(tmp_path, {"renamed.txt": "other.pt", "truncated": blobs["model.pt"][:600]}, blobs)
    legacy = tmp_path / "legacy.bin"
    torch.save({"a": 1}, legacy, _use_new_zipfile_serialization=False)
    assert all(is_checkpoint(tmp_path / n) for n in ("model.pt", "renamed.txt", "truncated", "legacy.bin"))
    assert not any(is_checkpoint(tmp_path / n) for n in ("in.de", "missing.pt"))
    assert not is_checkpoint(Path(os.devnull))
