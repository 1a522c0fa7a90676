"""CTranslate2 export: for each block kind, a briefly trained model exported float32 translates as
our own decoding does (greedy token for token; beam 5 wherever our search ended with EOS before
the length limit), and exported int8 scores our translations as our float32 model does, within
quantization error; models CTranslate2 cannot express, and outputs that would be overwritten, are
refused with one error line."""

import copy
import math
import statistics
from pathlib import Path

import pytest
import torch

from transformer import checkpoint
from transformer.decoding import DecodeConfig, translate_ids
from transformer.decoding.beam import add_finished, best_extensions
from transformer.fast.int8 import ROW_SCALE, exact_weight_levels
from transformer.interop.export import export
from transformer.interop.export import translate_ids as ctranslate2_ids

from .briefly_trained import multi30k_corpus, trained_model
from .test_bad_inputs import entry_point

ctranslate2 = pytest.importorskip("ctranslate2")
TIE = 1e-4  # log-probabilities closer than this are equal to fp32 rounding over a sentence  # in the dev extra; skipped only where it has no wheel

KINDS = {
    "paper": {},  # post-norm, LayerNorm, sinusoidal, ReLU, MHA with bias, joint vocabulary, tied output
    "small_modern": dict(norm_first=True, norm="rmsnorm", positional="rope", activation="swiglu"),
    "gqa": dict(n_kv_heads=2),
    "mqa_no_bias": dict(n_kv_heads=1, bias=False),
    "separate_vocab": dict(separate=True),
    "gelu": dict(activation="gelu"),
    "learned": dict(positional="learned"),
    "untied": dict(tie_output=False),
    "marian_block": dict(activation="silu", sinusoidal_layout="halves", output_bias=True),
}


@pytest.fixture(scope="module")
def corpus():
    return multi30k_corpus()


@pytest.fixture(scope="module")
def trained(corpus):
    """trained_model(corpus, KINDS[kind]) by kind, each trained once for the float32 and int8 tests."""
    models = {}

    def model_of(kind: str):
        if kind not in models:
            models[kind] = trained_model(corpus, KINDS[kind])
        return models[kind]

    return model_of


@pytest.mark.e2e
@pytest.mark.isa  # CTranslate2 picks its kernels by CPU too (CT2_FORCE_CPU_ISA in ISA_LIMITS)
@pytest.mark.parametrize("kind", KINDS)
def test_exported_model_decodes_as_ours(kind, corpus, trained, tmp_path):
    model, tokenizer = trained(kind)
    export(model, tokenizer, tmp_path / "ct2", "float32")
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", compute_type="float32")
    problems = disagreements(model, tokenizer, translator, tokenizer.source.encode(corpus[0][:24]))
    assert not problems, problems[0]


@pytest.mark.e2e
def test_an_export_off_by_a_percent_in_one_layer_is_told_apart(corpus, trained, tmp_path):
    """The property above is not vacuous: an export of the same model with one decoder layer's
    feed-forward output scaled by 1.01 disagrees with ours."""
    model, tokenizer = trained("small_modern")
    altered = copy.deepcopy(model)
    with torch.no_grad():
        altered.decoder_layers[-1].ffn.down.weight.mul_(1.01)
    export(altered, tokenizer, tmp_path / "ct2", "float32")
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", compute_type="float32")
    problems = disagreements(model, tokenizer, translator, tokenizer.source.encode(corpus[0][:24]))
    assert problems and "scores" in problems[0], problems


def disagreements(model, tokenizer, translator, sources: list[list[int]]) -> list[str]:
    """Where CTranslate2's float32 export and our model disagree beyond fp32 rounding, which no
    correct pair of implementations does on any CPU:
    - as functions: CTranslate2 scores our translations as our model does (each sentence's
      log-probability within TIE);
    - as searches: greedy search gives the same tokens, and beam search the same translations
      where both ended before the length limit (at the limit our search scores a hypothesis with
      a forced EOS, CTranslate2 without one), unless the translations part at a tie that another
      CPU's rounding may break the other way: for greedy, the two tokens where they part have
      log-probabilities within TIE; for beam search, our search of that sentence met a decision
      (which candidates survive a step or end among its best k, which finished hypothesis is
      best) between two scores within TIE. With no such tie, a search over scores that agree
      within rounding keeps the same beams at every step, whatever the CPU."""
    problems = []
    for cfg in (DecodeConfig(strategy="greedy"), DecodeConfig(beam_size=5, length_penalty=0.0)):
        ours = [hyps[0].tokens for hyps in translate_ids(model, sources, tokenizer, cfg, "cpu")]
        theirs = ctranslate2_ids(translator, tokenizer, sources, cfg, model.cfg.max_positions)
        mine, its = token_log_probs(model, tokenizer, sources, ours), ctranslate2_log_probs(translator, tokenizer, sources, ours)  # fmt: skip
        problems += [
            f"{cfg.label}: sentence {i}: CTranslate2 scores our translation {sum(b):.6f}, our model {sum(a):.6f}"
            for i, (a, b) in enumerate(zip(mine, its))
            if abs(sum(a) - sum(b)) >= TIE
        ]
        limits = [int((len(s) + 1) * cfg.max_len_a + cfg.max_len_b) - 1 for s in sources]
        ended = [i for i in range(len(sources)) if max(len(ours[i]), len(theirs[i])) < limits[i]]
        compared = list(range(len(sources))) if cfg.strategy == "greedy" else ended
        if len(compared) < len(sources) // 4:
            problems.append(f"{cfg.label}: only {len(compared)} translations end before the limit")
        tied = greedy_tie if cfg.strategy == "greedy" else beam_tie
        problems += [
            f"{cfg.label}: sentence {i}: ours {ours[i]}, CTranslate2 {theirs[i]}, and no tie explains it"
            for i in compared
            if ours[i] != theirs[i] and not tied(model, tokenizer, sources[i], ours[i], theirs[i], cfg)
        ]
    return problems


def greedy_tie(model, tokenizer, source: list[int], ours: list[int], theirs: list[int], cfg: DecodeConfig) -> bool:
    """Whether the two tokens where two greedy outputs part have log-probabilities within TIE."""
    ours, theirs = ours + [tokenizer.eos_id], theirs + [tokenizer.eos_id]
    at = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([source + [tokenizer.eos_id]]), torch.tensor([[tokenizer.bos_id] + ours[:at]]))
    log_probs = logits[0, -1].log_softmax(-1)
    return abs(log_probs[ours[at]] - log_probs[theirs[at]]).item() < TIE


def beam_tie(model, tokenizer, source: list[int], ours: list[int], theirs: list[int], cfg: DecodeConfig) -> bool:
    """Whether our beam search of `source` meets a decision between two scores within TIE. The
    search runs again on the sentence alone, watching each step's candidates: of the best 2k
    (sorted), one ending in EOS is finished if it ranks among the first k, and the first k that
    do not end survive. Swapping two neighbours changes that only across those two boundaries."""
    margins = []

    def watched(scores, lprobs, count):
        top, index = best_extensions(scores, lprobs, count)
        k, ends = count // 2, ((index % lprobs.size(1) == tokenizer.eos_id) & top.isfinite())[0].tolist()
        candidates = top[0].tolist()
        if ends[k - 1] or ends[k]:  # an ending candidate at the edge of the best k
            margins.append(candidates[k - 1] - candidates[k])
        going_on = [score for score, end in zip(candidates, ends) if not end]
        if len(going_on) > k:
            margins.append(going_on[k - 1] - going_on[k])
        return top, index

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("transformer.decoding.beam.best_extensions", watched)
        patch.setattr("transformer.decoding.beam.add_finished", watch_finished := FinishedWatch(add_finished))
        again = translate_ids(model, [source], tokenizer, cfg, "cpu")[0][0].tokens
    finished = sorted((h.score for h in watch_finished.hypotheses), reverse=True)
    margins += [a - b for a, b in zip(finished, finished[1:2])]
    # Alone or among others the sentence is searched over scores within rounding of each other: a
    # different output alone is itself a tie of our own search.
    return again != ours or min(margins, default=math.inf) < TIE


class FinishedWatch:
    """add_finished, keeping the finished hypotheses of the first sentence."""

    def __init__(self, add):
        self.add, self.hypotheses = add, []

    def __call__(self, finished, *args, **kwargs):
        self.add(finished, *args, **kwargs)
        self.hypotheses = finished[0] if finished else self.hypotheses


def ctranslate2_log_probs(
    translator, tokenizer, sources: list[list[int]], targets: list[list[int]]
) -> list[list[float]]:
    """CTranslate2's log-probability of each target token and of the EOS after it."""
    source_pieces = [[tokenizer.source.id_to_piece(t) for t in s] for s in sources]
    target_pieces = [[tokenizer.id_to_piece(t) for t in s] for s in targets]
    return [r.log_probs for r in translator.score_batch(source_pieces, target_pieces, max_input_length=0)]


def token_log_probs(model, tokenizer, sources: list[list[int]], targets: list[list[int]]) -> list[list[float]]:
    """Our model's log-probability of each target token and of the EOS after it, teacher-forced."""
    out = []
    with torch.no_grad():
        for src, tgt in zip(sources, targets):
            gold = torch.tensor(tgt + [tokenizer.eos_id])
            logits = model(torch.tensor([src + [tokenizer.eos_id]]), torch.tensor([[tokenizer.bos_id] + tgt]))
            out.append(logits[0].log_softmax(-1)[torch.arange(len(gold)), gold].tolist())  # (tgt_len + 1,)
    return out


@pytest.mark.e2e
@pytest.mark.isa  # CTranslate2 picks its kernels by CPU too (CT2_FORCE_CPU_ISA in ISA_LIMITS)
@pytest.mark.parametrize("kind", KINDS)
def test_int8_export_scores_our_translations_as_our_float32_model_does(kind, corpus, trained, tmp_path):
    """Per-token log-probabilities rather than translations: greedy search on a tiny model parts
    ways at near-ties that int8 rounding tips (about half the sentences), and CTranslate2 picks its
    int8 kernels by CPU. The tolerance is several times the rounding error; a model exported with
    its weights scrambled is off by whole nats."""
    model, tokenizer = trained(kind)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    export(model, tokenizer, tmp_path / "ct2", "int8")  # quantizes copies, not the model's own weights
    assert [name for name, t in model.state_dict().items() if not torch.equal(t, before[name])] == []
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", compute_type="int8")
    sources = tokenizer.source.encode(corpus[0][:24])
    targets = [hyps[0].tokens for hyps in translate_ids(model, sources, tokenizer, DecodeConfig(strategy="greedy"), "cpu")]  # fmt: skip
    ours = token_log_probs(model, tokenizer, sources, targets)
    theirs = ctranslate2_log_probs(translator, tokenizer, sources, targets)
    assert [len(lp) for lp in theirs] == [len(lp) for lp in ours]  # each token and the EOS
    errors = [abs(a - b) for mine, its in zip(ours, theirs) for a, b in zip(mine, its)]
    # Where the CPU's int8 dot products lack VNNI (what our own start-up check finds as saturation),
    # CTranslate2's int8 products are coarser too: mean 0.2-0.4 nats instead of 0.01-0.02 (ISA matrix).
    mean_bound, max_bound = (0.1, 1.0) if exact_weight_levels() == ROW_SCALE else (0.6, 6.0)
    assert statistics.mean(errors) < mean_bound and max(errors) < max_bound, f"|log p(int8) - log p(ours)|: mean {statistics.mean(errors):.3f}, max {max(errors):.3f} over {len(errors)} tokens"  # fmt: skip


def test_export_directory_holds_tokenizers_and_note(corpus, tmp_path):
    model, tokenizer = trained_model(corpus, {"separate": True}, steps=1)
    export(model, tokenizer, tmp_path / "ct2", "int8")
    files = {p.name for p in (tmp_path / "ct2").iterdir()}
    assert {"model.bin", "config.json", "spm.model", "spm.src.model", "README.md"} <= files
    assert (tmp_path / "ct2" / "spm.src.model").read_bytes() == tokenizer.source_bytes
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    assert translator.translate_batch([["▁Ein"]], max_decoding_length=3)[0].hypotheses


def saved_checkpoint(corpus, path: Path, options: dict) -> Path:
    model, tokenizer = trained_model(corpus, options, steps=0)
    checkpoint.save(path, model, tokenizer, {"data": {"src_lang": "de", "tgt_lang": "en"}}, step=0)
    return path


def run_export(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        entry_point("scripts/export_ctranslate2.py").main(argv)
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.mark.parametrize("kind", ["moh", "dcmha", "overlap"])
def test_inexpressible_attention_is_refused(kind, corpus, tmp_path, capsys):
    path = saved_checkpoint(corpus, tmp_path / "model.pt", {"attention": {"kind": kind, "overlap": 2}})
    code, _, err = run_export([f"checkpoint={path}", f"output={tmp_path / 'out'}"], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error:") and f"model.attention.kind={kind}" in err
    assert not (tmp_path / "out").exists()


def test_existing_output_is_not_overwritten_unless_asked(corpus, tmp_path, capsys):
    path = saved_checkpoint(corpus, tmp_path / "model.pt", {})
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    code, _, err = run_export([f"checkpoint={path}", f"output={output}"], capsys)
    assert code == 2 and err.startswith("error:") and "overwrite=true" in err
    assert (output / "keep.txt").read_text() == "mine"
    for target in (path, tmp_path):  # the checkpoint itself; a directory above nothing new
        code, _, err = run_export([f"checkpoint={path}", f"output={target}"], capsys)
        assert code == 2 and err.count("\n") == 1 and err.startswith("error:")
    assert checkpoint.load(path)["step"] == 0
    code, out, _ = run_export([f"checkpoint={path}", f"output={output}", "overwrite=true"], capsys)
    assert code == 0 and "exported" in out
    assert not (output / "keep.txt").exists() and (output / "model.bin").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


@pytest.mark.parametrize("argv", [["quantization=int4"], ["checkpoint=missing.pt"], ["output=x"]])
def test_bad_arguments_get_one_error_line(argv, tmp_path, capsys):
    args = {"checkpoint": str(tmp_path / "missing.pt"), "output": str(tmp_path / "out")}
    args.update(arg.split("=", 1) for arg in argv)
    if argv == ["output=x"]:
        del args["checkpoint"]
    code, _, err = run_export([f"{k}={v}" for k, v in args.items()], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error:"), err
