"""Compare the attention variants on Multi30k at the same training wall-clock budget and write
the table of docs/ATTENTION.md.

    python scripts/lab/attention_lab.py minutes=10                 # train what is missing, then report
    python scripts/lab/attention_lab.py minutes=10 only=[mha,moh]  # a subset
    python scripts/lab/attention_lab.py report_only=true           # rewrite the table from finished runs

Each variant is one `train.py` run (the default experiment, multi30k_de_en, with the overrides
below and trainer.max_minutes=minutes) in out/<variant>; a finished run (results.json present)
is reused. Then, for each run: beam-5 decoding speed on test_2016_flickr, the key/value cache
per generated token, and, from the MHA run, MHA -> GQA conversions (scripts/convert_to_gqa.py's,
all in this process: the MHA checkpoint is loaded and scored once).
Hyper-parameters are those of the default recipe, chosen on the validation split; the test
split is only scored.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformer.checkpoint import load_model, train_config_of
from transformer.cli import parse_args, setup_logging
from transformer.data import DataConfig, load_split
from transformer.decoding import DecodeConfig
from transformer.errors import ConfigError, exit_on_user_error
from transformer.files import atomic_write_text, check_output
from transformer.interop.gqa import kv_cache_bytes_per_token
from transformer.translator import Translator

ROOT = Path(__file__).resolve().parents[2]

# The attention variants are compared in the paper's block (post-norm, sinusoidal positions,
# LayerNorm, ReLU), whatever block the default recipe uses; "modern" swaps the whole block.
PAPER_BLOCK = ["model.norm_first=false", "model.positional=sinusoidal", "model.norm=layernorm", "model.activation=relu"]
MODERN_BLOCK = ["model.norm_first=true", "model.positional=rope", "model.norm=rmsnorm", "model.activation=swiglu"]
VARIANTS = {
    "mha": ("standard multi-head attention", PAPER_BLOCK),
    "gqa2": ("grouped-query, 2 key/value heads", [*PAPER_BLOCK, "model.n_kv_heads=2"]),
    "mqa": ("multi-query, 1 key/value head", [*PAPER_BLOCK, "model.n_kv_heads=1"]),
    "moh": ("MoH: 1 shared + top-2 of 3 routed heads", [*PAPER_BLOCK, "model/attention=moh"]),
    "dcmha": ("DCMHA, rank 2", [*PAPER_BLOCK, "model/attention=dcmha"]),
    "overlap": ("overlapping heads, 16 features each side", [*PAPER_BLOCK, "model/attention=overlap"]),
    "modern": ("RoPE + RMSNorm + SwiGLU, pre-norm", MODERN_BLOCK),
}
CONVERSIONS = {  # name: (n_kv_heads, align, fine-tune)
    "mha_to_gqa2_mean": (2, False, False),
    "mha_to_gqa2_aligned": (2, True, False),
    "mha_to_gqa2_aligned_ft": (2, True, True),
    "mha_to_mqa_aligned_ft": (1, True, True),
}
START, END = "<!-- attention-lab:start -->", "<!-- attention-lab:end -->"


@dataclass
class LabConfig:
    minutes: float = 10.0
    only: list[str] = field(default_factory=list)
    out: str = "outputs/attention_lab"
    doc: str = "docs/ATTENTION.md"
    speed_sentences: int = 500
    conversions: bool = True
    finetune_steps: int = 300  # for the conversions that fine-tune
    report_only: bool = False
    extra: list[str] = field(default_factory=list)  # more train.py overrides for every run (e.g. a smaller experiment)

    def __post_init__(self) -> None:
        if not 0 < self.minutes < math.inf:  # trainer.max_minutes=0 would mean no budget at all
            raise ValueError(f"minutes={self.minutes} must be > 0 and finite")
        for key in ("speed_sentences", "finetune_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        unknown = [name for name in self.only if name not in VARIANTS]
        if unknown:
            raise ValueError(f"only: {unknown[0]!r} is not one of {list(VARIANTS)}")


def train(name: str, overrides: list[str], cfg: LabConfig, out: Path) -> None:
    run_dir = out / name
    if (run_dir / "results.json").is_file():
        print(f"{name}: reusing {run_dir}")
        return
    command = [sys.executable, "train.py", f"trainer.max_minutes={cfg.minutes}", f"hydra.run.dir={run_dir}", "trainer.overwrite=true", *cfg.extra, *overrides]  # fmt: skip
    print(f"{name}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def decode_speed(run_dir: Path, n: int) -> float:
    """Beam-5 sentences per second on the first n test_2016_flickr sources (batched as translate.py does)."""
    beam = DecodeConfig(strategy="beam", beam_size=5)
    translator = Translator.load(run_dir / "checkpoint_best.pt", [], "cpu", beam)
    data = train_config_of(translator.payload, run_dir / "checkpoint_best.pt")["data"]
    split = load_split(DataConfig(dir=data["dir"], src_lang=data["src_lang"], tgt_lang=data["tgt_lang"]), "test_2016_flickr")  # fmt: skip
    sources = list(split["src"])[:n]
    started = time.perf_counter()
    translator.translate(sources)
    return len(sources) / (time.perf_counter() - started)


def convert_all(out: Path, finetune_steps: int) -> None:
    """The MHA -> GQA conversions of the mha run's best checkpoint not made yet, in this process
    (scripts/convert_to_gqa.py's convert_all: the checkpoint is loaded and scored once for all)."""
    todo = {}
    for name, (k, align, finetune) in CONVERSIONS.items():
        output = out / "conversions" / f"{name}.pt"
        if output.with_suffix(".json").is_file():
            print(f"{name}: reusing {output}")
            continue
        steps = finetune_steps if finetune else 0
        todo[name] = [f"checkpoint={out / 'mha' / 'checkpoint_best.pt'}", f"n_kv_heads={k}", f"align={str(align).lower()}", f"finetune_steps={steps}", f"output={output}"]  # fmt: skip
    if not todo:
        return
    (out / "conversions").mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "scripts"))
    import convert_to_gqa

    setup_logging()
    configs = []
    for name, args in todo.items():
        print(f"{name}: scripts/convert_to_gqa.py {' '.join(args)}", flush=True)  # the same conversion on its own
        configs.append(parse_args(args, convert_to_gqa.ConvertConfig, convert_to_gqa.__doc__, "convert_to_gqa"))
    convert_to_gqa.convert_all(configs)


EQUAL_STEP = 500  # every run validates here (eval_every): a comparison per step that CPU contention cannot skew


def validation_at(run_dir: Path, step: int) -> dict:
    """The validation record of `step` in the run's metrics.jsonl ({} if it never validated there)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next((r for r in records if r.get("step") == step and "valid_bleu" in r), {})


def row_of_run(name: str, run_dir: Path, speed: float) -> dict:
    results = json.loads((run_dir / "results.json").read_text())
    at_step = validation_at(run_dir, EQUAL_STEP)
    model, _, _ = load_model(run_dir / "checkpoint_best.pt")
    beam = results["test"]["test_2016_flickr/beam5"]
    return {
        "variant": name,
        "description": VARIANTS[name][0],
        "parameters": results["parameters"],
        "tokens_per_s": results["tokens_per_s"],
        "steps": results["steps"],
        "train_minutes": results["train_minutes"],
        "valid_bleu": results["valid_best"],
        "valid_bleu_at_step": at_step.get("valid_bleu", float("nan")),
        "valid_ppl_at_step": at_step.get("valid_ppl", float("nan")),
        "test_bleu": beam["bleu"],
        "signature": beam["bleu_signature"],
        "beam5_sentences_per_s": speed,
        "kv_bytes_per_token": kv_cache_bytes_per_token(model.cfg)["self_per_target_token"],
    }


def score(scores: dict, split: str) -> str:
    return f"{scores[split]:.2f}" if split in scores else "–"


def at_step(row: dict) -> str:
    if math.isnan(row["valid_bleu_at_step"]):
        return f"– (stopped at {row['steps']})"
    return f"{row['valid_bleu_at_step']:.2f} / {row['valid_ppl_at_step']:.1f}"


def markdown(rows: list[dict], conversions: dict[str, dict], extra: list[str]) -> str:
    minutes = max((r["train_minutes"] for r in rows), default=0.0)
    recipe = "the default recipe" + (f" with `{' '.join(extra)}`" if extra else "")
    lines = [
        f"Multi30k de-en, {minutes:.0f} minutes of training each on the same 2-core CPU, {recipe}, model/small otherwise; "
        "validation BLEU: greedy, best checkpoint; test: test_2016_flickr, beam 5, sacreBLEU "
        f"`{rows[0]['signature'] if rows else ''}`; KV cache: decoder self-attention keys and values per "
        f"generated token, fp32. The step-{EQUAL_STEP} columns compare the variants at equal steps (greedy BLEU and "
        "perplexity on the validation split), which CPU speed cannot skew.",
        "",
        f"| variant | parameters | train tok/s | steps | valid BLEU | test BLEU | valid BLEU / ppl at step {EQUAL_STEP} | beam-5 sent/s | KV bytes/token |",  # fmt: skip
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']}: {r['description']} | {r['parameters']:,} | {r['tokens_per_s']:,.0f} | {r['steps']:,} "
            f"| {r['valid_bleu']:.2f} | {r['test_bleu']:.2f} | {at_step(r)} "
            f"| {r['beam5_sentences_per_s']:.1f} | {r['kv_bytes_per_token']:,} |"
        )
    if conversions:
        lines += [
            "",
            "MHA -> GQA conversion of the `mha` run's best checkpoint (scripts/convert_to_gqa.py), BLEU with beam 5:",
            "",
            "| conversion | KV bytes/token | valid before | valid after | valid fine-tuned | test before | test after | test fine-tuned |",  # fmt: skip
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, c in conversions.items():
            ft = c.get("bleu_finetuned", {})
            steps = f", {c['finetune_steps']} steps" if c.get("finetune_steps") else ""
            lines.append(
                f"| {name}{steps} | {c['kv_cache_bytes_after']['self_per_target_token']:,} "
                f"| {c['bleu_before']['val']:.2f} | {c['bleu_converted']['val']:.2f} | {score(ft, 'val')} "
                f"| {c['bleu_before']['test_2016_flickr']:.2f} | {c['bleu_converted']['test_2016_flickr']:.2f} "
                f"| {score(ft, 'test_2016_flickr')} |"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, LabConfig, __doc__)
        doc = check_output(ROOT / cfg.doc, [], key="doc")  # before hours of training, not after
        if not doc.is_file():
            raise ConfigError(f"doc={cfg.doc} does not exist: the table goes between its {START} and {END} lines")
    out = ROOT / cfg.out
    names = cfg.only or list(VARIANTS)
    if not cfg.report_only:
        for name in names:
            train(name, VARIANTS[name][1], cfg, out)
        if cfg.conversions and "mha" in names:
            with exit_on_user_error():
                convert_all(out, cfg.finetune_steps)
    with exit_on_user_error():
        print(report(cfg, out, names, doc))


def report(cfg: LabConfig, out: Path, names: list[str], doc: Path) -> str:
    """The table of the finished runs, written into `doc` and out/summary.json."""
    rows = []
    for name in names:
        run_dir = out / name
        if not (run_dir / "results.json").is_file():
            continue
        speed_file = run_dir / "decode_speed.json"
        if not speed_file.is_file():
            atomic_write_text(speed_file, json.dumps({"beam5_sentences_per_s": decode_speed(run_dir, cfg.speed_sentences)}))  # fmt: skip
        rows.append(row_of_run(name, run_dir, json.loads(speed_file.read_text())["beam5_sentences_per_s"]))
    conversions = {}
    for name in CONVERSIONS:
        path = out / "conversions" / f"{name}.json"
        if path.is_file():
            conversions[name] = json.loads(path.read_text())
    table = markdown(rows, conversions, cfg.extra)
    summary = check_output(out / "summary.json", [], key=None)
    atomic_write_text(summary, json.dumps({"rows": rows, "conversions": conversions}, indent=2) + "\n")
    text = doc.read_text()
    if START in text and END in text:
        head, rest = text.split(START, 1)
        atomic_write_text(doc, head + START + "\n" + table + "\n" + END + rest.split(END, 1)[1])
    return table


if __name__ == "__main__":
    main(sys.argv[1:])
