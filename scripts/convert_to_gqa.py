"""Convert a trained multi-head attention checkpoint to grouped-query attention, then optionally
fine-tune it, reporting BLEU before, right after and after fine-tuning, and the KV-cache size.

    python scripts/convert_to_gqa.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt n_kv_heads=2
    python scripts/convert_to_gqa.py checkpoint=PATH n_kv_heads=1 align=false finetune_steps=300

Arguments (key=value):
    checkpoint=PATH      a model trained with standard attention (n_kv_heads = n_heads)
    n_kv_heads=K         key/value heads after conversion; must divide n_heads
    align=true           group and align heads on calibration data before mean pooling
    calibration=500      training sentence pairs used for alignment
    finetune_steps=0     training steps after conversion (0: none)
    finetune_lr=2e-4     peak learning rate of the fine-tuning (warmup: a tenth of the steps)
    splits=[val,test_2016_flickr]   splits scored with sacreBLEU; the first is the validation split
    output=PATH          default: checkpoint_gqa<K>.pt next to the input (_ft when fine-tuned)
    results=PATH         JSON with every score; default: output with .json
    decode.*             as for evaluate.py (default: beam 5)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from transformer import checkpoint
from transformer.cli import parse_args, setup_logging
from transformer.config import Config, to_config
from transformer.data import load_split
from transformer.data.batching import TokenizedCorpus, collate, token_batches, tokenize
from transformer.data.tokenizer import Tokenizer
from transformer.decoding import DecodeConfig
from transformer.devices import pick_device
from transformer.errors import ConfigError, exit_on_user_error
from transformer.evaluation import score
from transformer.files import atomic_write_text, check_output, same_file
from transformer.interop.gqa import convert_to_gqa, kv_cache_bytes_per_token
from transformer.model import Transformer
from transformer.training import Trainer
from transformer.training.experiment import prepare_data, seed_everything
from transformer.translator import Translator

log = logging.getLogger("convert_to_gqa")


@dataclass
class ConvertConfig:
    checkpoint: str = "???"
    n_kv_heads: int = 1
    align: bool = True
    calibration: int = 500
    finetune_steps: int = 0
    finetune_lr: float = 2e-4
    splits: list[str] = field(default_factory=lambda: ["val", "test_2016_flickr"])
    output: Optional[str] = None
    results: Optional[str] = None
    device: str = "auto"
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        for key, low in (("n_kv_heads", 1), ("calibration", 1), ("finetune_steps", 0)):  # finetune_steps=0: none
            if getattr(self, key) < low:
                raise ValueError(f"{key}={getattr(self, key)} must be >= {low}")
        if not 0 < self.finetune_lr < math.inf:
            raise ValueError(f"finetune_lr={self.finetune_lr} must be > 0 and finite")


def bleu_scores(model, tokenizer, train_cfg: Config, cfg: ConvertConfig, device) -> dict[str, float]:
    translator, scores = Translator.of_training(model, tokenizer, cfg.decode), {}
    for split in cfg.splits:
        corpus = tokenize(load_split(train_cfg.data, split), tokenizer, train_cfg.data.tgt_lang)
        hyps = translator.translate_corpus(corpus)
        result = score(hyps, corpus.tgt_text)
        scores[split] = result.bleu
        log.info("%s", result.summary(f"{split} {cfg.decode.label}"))
    return scores


def calibration_batches(train, tokenizer, n: int, device) -> list:
    """About n training pairs, as (src, tgt_in) batches."""
    rows = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:n].numpy()
    lengths = train.lengths()[rows]
    batches = []
    for positions in token_batches(lengths, 4096):
        batch = collate(train, rows[positions], tokenizer).to(device)
        batches.append((batch.src, batch.tgt_in))
    return batches


def finetune(model, tokenizer, train_cfg: Config, cfg: ConvertConfig, train, valid, run_dir: Path) -> None:
    """cfg.finetune_steps steps of the training run's recipe at cfg.finetune_lr, from the training
    run's seed: a conversion fine-tunes alike whether it is the only one in its process or not."""
    trainer_cfg = dataclasses.replace(
        train_cfg.trainer,
        lr=cfg.finetune_lr,
        warmup_steps=max(1, cfg.finetune_steps // 10),
        max_steps=cfg.finetune_steps,
        max_minutes=0,
        max_epochs=0,
        eval_every=cfg.finetune_steps,
        keep_last=0,
        average_last=0,
        attention_images=False,
        resume=None,
        overwrite=True,
    )
    run_cfg = dataclasses.replace(train_cfg, trainer=trainer_cfg, model=model.cfg)
    seed_everything(train_cfg.seed)
    trainer = Trainer(run_cfg, run_dir, model, tokenizer, train, valid)
    trainer.fit()
    trainer.monitor.close()


@dataclass
class Original:
    """The MHA checkpoint: loaded, scored and its training data prepared once, however many
    conversions are made of it (scripts/lab/attention_lab.py makes four in one process)."""

    model: Transformer
    tokenizer: Tokenizer
    payload: dict
    train_cfg: Config
    bleu: dict[str, float] = field(default_factory=dict)
    train: Optional[TokenizedCorpus] = None
    valid: Optional[TokenizedCorpus] = None


def load_original(cfg: ConvertConfig, device) -> Original:
    loaded = Translator.load(cfg.checkpoint, [], str(device), cfg.decode)
    train_cfg = to_config(OmegaConf.create(checkpoint.train_config_of(loaded.payload, cfg.checkpoint)))
    return Original(loaded.model, loaded.tokenizer, loaded.payload, train_cfg)


def score_original(original: Original, cfg: ConvertConfig, device) -> None:
    log.info("scoring the MHA model")
    original.bleu = bleu_scores(original.model, original.tokenizer, original.train_cfg, cfg, device)
    _, original.train, original.valid = prepare_data(original.train_cfg, original.tokenizer)


@dataclass
class Outputs:
    """Where one conversion writes: the converted checkpoint, its results, the fine-tuning's run."""

    checkpoint: Path
    results: Path
    run_dir: Path


def check_conversion(cfg: ConvertConfig, original: Original) -> Outputs:
    """The outputs of converting `original` as cfg asks, checked before anything is scored."""
    try:
        dataclasses.replace(original.model.cfg, n_kv_heads=cfg.n_kv_heads)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    suffix = f"_gqa{cfg.n_kv_heads}" + ("_ft" if cfg.finetune_steps else "")
    output = check_output(cfg.output or Path(cfg.checkpoint).with_name(Path(cfg.checkpoint).stem + suffix + ".pt"), [cfg.checkpoint])  # fmt: skip
    results = check_output(cfg.results or output.with_suffix(".json"), [cfg.checkpoint, output], key="results")
    run_dir = output.with_suffix("")  # where fine-tuning writes its checkpoints
    if cfg.finetune_steps and same_file(run_dir, Path(cfg.checkpoint).parent):
        raise ConfigError(f"output={output}: fine-tuning would write into {run_dir}, beside checkpoint={cfg.checkpoint}; choose another output")  # fmt: skip
    return Outputs(output, results, run_dir)


def convert(original: Original, cfg: ConvertConfig, outputs: Outputs, device) -> dict:
    """The scored `original` converted as cfg asks, scored, fine-tuned and scored again; writes the
    converted checkpoint and the results, and returns the results."""
    model, tokenizer, train_cfg = original.model, original.tokenizer, original.train_cfg
    converted_cfg = dataclasses.replace(model.cfg, n_kv_heads=cfg.n_kv_heads)
    results: dict = {"checkpoint": cfg.checkpoint, "n_heads": model.cfg.n_heads, "n_kv_heads": cfg.n_kv_heads}
    results["kv_cache_bytes_before"] = kv_cache_bytes_per_token(model.cfg)
    results["kv_cache_bytes_after"] = kv_cache_bytes_per_token(converted_cfg)
    results["bleu_before"] = dict(original.bleu)

    calibration = calibration_batches(original.train, tokenizer, cfg.calibration, device) if cfg.align else None
    started = time.monotonic()
    try:
        converted = convert_to_gqa(model, cfg.n_kv_heads, calibration)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    results["convert_seconds"] = round(time.monotonic() - started, 2)
    log.info("converted to %d key/value heads in %.1fs; scoring", cfg.n_kv_heads, results["convert_seconds"])
    results["bleu_converted"] = bleu_scores(converted, tokenizer, train_cfg, cfg, device)

    if cfg.finetune_steps:
        outputs.run_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        finetune(converted, tokenizer, train_cfg, cfg, original.train, original.valid, outputs.run_dir)
        results["finetune_steps"] = cfg.finetune_steps
        results["finetune_minutes"] = round((time.monotonic() - started) / 60, 2)
        results["bleu_finetuned"] = bleu_scores(converted, tokenizer, train_cfg, cfg, device)

    payload = original.payload
    checkpoint.save(outputs.checkpoint, converted, tokenizer, train_config=payload["train_config"], step=payload.get("step", 0), converted_from=cfg.checkpoint)  # fmt: skip
    atomic_write_text(outputs.results, json.dumps(results, indent=2) + "\n")
    return results


def convert_all(configs: list[ConvertConfig]) -> list[tuple[dict, Outputs]]:
    """Conversions of one checkpoint in this process (one for the command, several for
    scripts/lab/attention_lab.py), which share its device, decoding and splits: it is loaded,
    scored and its data prepared once, and every conversion's outputs are checked before anything
    is scored. Returns the results of each and where they were written."""
    shared = ("checkpoint", "device", "decode", "splits")
    differ = [key for key in shared if any(getattr(cfg, key) != getattr(configs[0], key) for cfg in configs)]
    if differ:
        raise ConfigError(f"conversions made together share {', '.join(shared)}; these differ: {', '.join(differ)}")
    device = pick_device(configs[0].device)
    original = load_original(configs[0], device)
    outputs = [check_conversion(cfg, original) for cfg in configs]
    score_original(original, configs[0], device)
    return [(convert(original, cfg, out, device), out) for cfg, out in zip(configs, outputs)]


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        ((results, outputs),) = convert_all([parse_args(argv, ConvertConfig, __doc__)])
        print(json.dumps(results, indent=2))
        print(f"wrote {outputs.checkpoint} and {outputs.results}")


if __name__ == "__main__":
    main(sys.argv[1:])
