"""Fine-tuning: a run that starts from another checkpoint's weights (`init_from=PATH`).

The checkpoint gives the model (weights and architecture) and the tokenizer; the new run's
configuration gives everything else: data, optimizer, schedule, budgets, regularization (the
model's dropout rates among them) and decoding. Step, optimizer and schedule start afresh. This
is not resuming (resume.py), which continues one run exactly and refuses any change of config;
a fine-tuning run, once started, resumes like any other run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

from torch import nn

from .. import checkpoint
from ..errors import ConfigError
from ..files import atomic_write_text
from ..model import ModelConfig

log = logging.getLogger(__name__)

# The model's keys that the new run sets: regularization, not architecture.
REGULARIZATION = ("dropout", "attention_dropout", "activation_dropout", "word_dropout")
VOCABULARY = ("vocab_size", "joint_vocab", "spm_model_type")  # data keys that would retrain the tokenizer
ORIGIN_FILE = "init_from.json"


def load_init(path: str) -> dict:
    """The checkpoint to start from, with its path, refused if it cannot give a model."""
    payload = checkpoint.load(Path(path)) | {"path": str(path)}
    try:
        ModelConfig(**payload["model_config"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"init_from={path} has a bad model_config: {checkpoint.first_line(e)}") from None
    return payload


def configure(cfg, init: dict):
    """cfg with the checkpoint's architecture and cfg's regularization, and the data keys that
    describe the checkpoint's vocabulary (so that the run's train_config tells the truth)."""
    if cfg.trainer.members > 1:
        raise ConfigError("init_from with trainer.members > 1 is not supported: fine-tune one model per run")
    saved = ModelConfig(**init["model_config"])
    model = dataclasses.replace(saved, **{key: getattr(cfg.model, key) for key in REGULARIZATION})
    saved_data = (init.get("train_config") or {}).get("data") or {}
    data = dataclasses.replace(cfg.data, **{key: saved_data[key] for key in VOCABULARY if key in saved_data})
    return dataclasses.replace(cfg, model=model, data=data)


def check_overrides(cfg, overrides: list[str], init: dict) -> None:
    """Refuse, naming the key, a command-line override that would change the checkpoint's
    architecture (a model.* key other than the dropout rates, or a model group) or its vocabulary
    (data.vocab_size, data.joint_vocab, data.spm_model_type)."""
    saved_data = (init.get("train_config") or {}).get("data") or {}
    composed = dataclasses.asdict(cfg.model)
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~").replace("/", ".")
        if key == "model":  # a group: every key it sets, but the sizes that the tokenizer decides
            names = [name for name in composed if name not in ("vocab_size", "src_vocab_size", "pad_id")]
        elif key.startswith("model."):
            names = [key.removeprefix("model.")]
        else:
            names = []
        for name in names:
            saved = value_at(init["model_config"], name)
            if name.split(".")[0] not in REGULARIZATION and value_at(composed, name) != saved:
                raise ConfigError(
                    f"{override}: init_from={init['path']} fixes the architecture, and its model.{name} is "
                    f"{json.dumps(saved)} (only the dropout rates may change)"
                )
        name = key.removeprefix("data.")
        if key.startswith("data.") and name in VOCABULARY and name in saved_data:
            if getattr(cfg.data, name) != saved_data[name]:
                raise ConfigError(
                    f"{override}: init_from={init['path']} brings its tokenizer, and its data.{name} is "
                    f"{json.dumps(saved_data[name])}"
                )


def value_at(values: dict, dotted: str):
    """values["a"]["b"] for "a.b"; None where a key is missing."""
    for part in dotted.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


def load_weights(model: nn.Module, init: dict) -> None:
    try:
        model.load_state_dict(init["model"])
    except RuntimeError as e:
        raise ConfigError(
            f"init_from={init['path']}: its weights do not fit ({checkpoint.first_line(e, skip=1)})"
        ) from None
    log.info("initialized from %s (its step %s)", init["path"], init.get("step"))


def freeze(model: nn.Module, parts: list[str]) -> None:
    """Stop training the named parts (trainer.freeze): embeddings (token embeddings, learned
    positions, an untied output layer), encoder, decoder (their layers and final norms). A tied
    output layer is the embedding matrix: frozen with the embeddings. The logits bias trains."""
    modules = {
        "embeddings": [model.embed, model.src_embed, model.positions, model.output],
        "encoder": [model.encoder_layers, model.encoder_norm],
        "decoder": [model.decoder_layers, model.decoder_norm],
    }
    for part in parts:
        for module in modules[part]:
            for parameter in module.parameters() if module is not None else ():
                parameter.requires_grad_(False)
    if parts:
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        log.info("frozen: %s (%s parameters)", ", ".join(parts), f"{frozen:,}")


def record_origin(run_dir: Path, init: dict) -> None:
    """run_dir/init_from.json: which checkpoint the run started from (path, step, SHA-256, and
    for an imported model where it came from)."""
    path = Path(init["path"])
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    origin = {"path": str(path.resolve()), "step": init.get("step"), "sha256": digest.hexdigest()}
    if "imported_from" in init:
        origin["imported_from"] = init["imported_from"]
    atomic_write_text(run_dir / ORIGIN_FILE, json.dumps(origin, indent=2) + "\n")
