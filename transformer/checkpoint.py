"""One self-contained checkpoint file: weights, model config, tokenizer, training config, step.

Everything in it is a tensor or a plain Python value, so it loads with
`torch.load(weights_only=True)`, which refuses arbitrary pickled objects.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import asdict
from pathlib import Path

import torch

from .model import ModelConfig, Transformer
from .tokenizer import Tokenizer

FORMAT_VERSION = 1


class CheckpointError(Exception):
    """A file that is not a loadable checkpoint of this format; the message names it."""


def save(path: Path, model: Transformer, tokenizer: Tokenizer, train_config: dict, step: int, **extra) -> None:
    """Write atomically: a crash mid-save leaves the previous file at `path` intact."""
    payload = {
        "format_version": FORMAT_VERSION,
        "model_config": asdict(model.cfg),
        "model": model.state_dict(),
        "tokenizer": as_tensor(tokenizer.model_bytes),
        "train_config": train_config,
        "step": step,
        **extra,
    }
    if tokenizer.source_bytes is not None:  # a separate source vocabulary
        payload["source_tokenizer"] = as_tensor(tokenizer.source_bytes)
    write(path, payload)


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def tokenizer_of(payload: dict) -> Tokenizer:
    """The tokenizer saved in a checkpoint's payload (with its separate source model, if any)."""
    source = payload.get("source_tokenizer")
    return Tokenizer(
        payload["tokenizer"].cpu().numpy().tobytes(), None if source is None else source.cpu().numpy().tobytes()
    )


def write(path: Path, payload: dict) -> None:
    """torch.save to a temporary file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path, map_location: str | torch.device = "cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first_line = str(e).strip().splitlines()[0]
        raise CheckpointError(f"{path} is not a safe checkpoint (refused to unpickle: {first_line})") from None
    except Exception as e:  # a foreign or damaged file can fail inside the unpickler in many ways
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or "format_version" not in payload:
        raise CheckpointError(f"{path} is not a checkpoint of this toolkit")
    if payload["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {payload['format_version']}, expected {FORMAT_VERSION}")
    return payload


def numbered(run_dir: Path) -> list[Path]:
    """A run's numbered checkpoints, checkpoint_<step>.pt, oldest first."""
    return sorted(Path(run_dir).glob("checkpoint_[0-9]*.pt"), key=lambda p: int(p.stem.split("_")[1]))


def keep_newest(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` numbered checkpoints of a run."""
    for old in numbered(run_dir)[:-keep] if keep > 0 else []:
        old.unlink()


def average(paths: list[Path]) -> dict:
    """A checkpoint whose weights are the mean of the given ones' (same model config required).

    Everything else (tokenizer, configs, step) comes from the last one; optimizer state is dropped.
    """
    payloads = [load(p) for p in paths]
    last = payloads[-1]
    for path, payload in zip(paths, payloads):
        if payload["model_config"] != last["model_config"]:
            raise CheckpointError(f"{path} has another model config than {paths[-1]}; cannot average")
    mean = {}
    for name, tensor in last["model"].items():
        if tensor.is_floating_point():
            mean[name] = (sum(p["model"][name].double() for p in payloads) / len(payloads)).to(tensor.dtype)
        else:
            mean[name] = tensor
    keep = {k: v for k, v in last.items() if k not in ("model", "optimizer", "train_state")}
    return {**keep, "model": mean, "averaged_from": [str(p) for p in paths]}


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer, dict]:
    """Model (in eval mode), tokenizer and the raw payload of a checkpoint."""
    payload = load(path, device)
    model = Transformer(ModelConfig(**payload["model_config"])).to(device)
    model.load_state_dict(payload["model"])
    return model.eval(), tokenizer_of(payload), payload
