"""One self-contained checkpoint file: weights, model config, tokenizer, training config, step.

Everything in it is a tensor or a plain Python value, so it loads with
`torch.load(weights_only=True)`, which refuses arbitrary pickled objects.
"""

from __future__ import annotations

import contextlib
import pickle
import re
from dataclasses import asdict
from pathlib import Path

import torch

from .data.tokenizer import Tokenizer, Vocabulary
from .errors import CheckpointError, DataError
from .files import atomic_open
from .model import ModelConfig, Transformer

FORMAT_VERSION = 1


def save(
    path: Path, model: Transformer, tokenizer: Tokenizer, train_config: dict, step: int, weights=None, **extra
) -> None:
    """Write atomically: a crash mid-save leaves the previous file at `path` intact. `weights`: a
    state dict of `model` to write instead of its current one (e.g. the best so far)."""
    payload = {
        "format_version": FORMAT_VERSION,
        "model_config": asdict(model.cfg),
        "model": model.state_dict() if weights is None else weights,
        "tokenizer": as_tensor(tokenizer.model_bytes),
        "train_config": train_config,
        "step": step,
        **extra,
    }
    if tokenizer.source_bytes is not None:  # a separate source vocabulary (or SentencePiece model)
        payload["source_tokenizer"] = as_tensor(tokenizer.source_bytes)
    if tokenizer.vocabulary is not None:  # ids of its own for the pieces (an imported model's)
        payload["vocabulary"] = tokenizer.vocabulary.to_dict()
    write(path, payload)


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def tokenizer_of(payload: dict, path: Path | None = None) -> Tokenizer:
    """The tokenizer saved in a checkpoint's payload (with its separate source model, if any);
    `path` (default: payload["path"], if set) names the checkpoint in errors."""
    source, name = payload.get("source_tokenizer"), path or payload.get("path", "the checkpoint")
    try:
        vocabulary = Vocabulary.from_dict(payload["vocabulary"]) if "vocabulary" in payload else None
        return Tokenizer(as_bytes(payload["tokenizer"]), None if source is None else as_bytes(source), vocabulary)
    except DataError as e:
        raise CheckpointError(f"{name}: its tokenizer is damaged ({e})") from None


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.cpu().numpy().tobytes()


def write(path: Path, payload: dict) -> None:
    """torch.save to a temporary file in the same directory, fsync, then rename over `path`."""
    with atomic_open(path) as f:
        torch.save(payload, f)


def load(path: Path, map_location: str | torch.device = "cpu") -> dict:
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused(path, e) from None
    except Exception as e:  # a foreign or damaged file can fail inside the unpickler in many ways
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or "format_version" not in payload:
        raise CheckpointError(f"{path} is not a checkpoint of this toolkit")
    if payload["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {payload['format_version']}, expected {FORMAT_VERSION}")
    check_entries(payload, path)
    return payload


def refused(path: Path, error: pickle.UnpicklingError) -> CheckpointError:
    """The safe loader refused `path`: why, in one line, without torch's advice to load it again
    with weights_only=False, which runs whatever code the file names. Every checkpoint this toolkit
    has written loads safely, so there is no trusted older format to offer a way around it for."""
    message = str(error)
    code = code_it_would_run(error)
    if code:
        return CheckpointError(
            f"{path} was refused as unsafe: it asks to run code when loaded ({code}), which no"
            " checkpoint of this toolkit does. It cannot be loaded; whoever made it should re-create it"
            " with train.py or convert it to this toolkit's format"
        )
    if "weights_only" not in message:  # the pickle data itself is broken
        return CheckpointError(f"{path} is not a readable checkpoint ({first_line(error)})")
    opcode = re.search(r"Unsupported operand \S+", message)
    detail = f": {opcode[0].lower()}" if opcode else ""
    return CheckpointError(f"{path} is not a checkpoint of this toolkit (the safe loader cannot read it{detail})")


def code_it_would_run(error: pickle.UnpicklingError) -> str | None:
    """The function or class a pickle refused by torch's safe loader would import and call, from
    torch's message; None when the refusal is for another reason."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return found[1] if found else None


def check_entries(payload: dict, path: Path) -> None:
    """The entries every checkpoint has, of the right kind: a damaged file names what it lacks."""
    for key, kind in (("model_config", dict), ("model", dict), ("tokenizer", torch.Tensor)):
        if not isinstance(payload.get(key), kind):
            what = "no" if key not in payload else f"a {type(payload[key]).__name__} as its"
            raise CheckpointError(f"{path} is damaged: it has {what} {key!r} entry")
    if not all(isinstance(t, torch.Tensor) for t in payload["model"].values()):
        raise CheckpointError(f"{path} is damaged: its 'model' entry holds something other than tensors")
    if payload["tokenizer"].dtype != torch.uint8:
        raise CheckpointError(f"{path} is damaged: its 'tokenizer' entry is not bytes ({payload['tokenizer'].dtype})")


def numbered(run_dir: Path) -> list[Path]:
    """A run's numbered checkpoints, checkpoint_<step>.pt, oldest first."""
    return sorted(Path(run_dir).glob("checkpoint_[0-9]*.pt"), key=step_of)


def step_of(path: Path) -> int:
    """The step of a numbered checkpoint, checkpoint_<step>.pt."""
    return int(Path(path).stem.split("_")[1])


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
        check_averageable(path, payload, paths[-1], last)
    mean = {}
    for name, tensor in last["model"].items():
        if tensor.is_floating_point():
            mean[name] = (sum(p["model"][name].double() for p in payloads) / len(payloads)).to(tensor.dtype)
        else:
            mean[name] = tensor
    keep = {k: v for k, v in last.items() if k not in ("model", "optimizer", "train_state")}
    return {**keep, "model": mean, "averaged_from": [str(p) for p in paths]}


def check_averageable(path: Path, payload: dict, last_path: Path, last: dict) -> None:
    """Checkpoints average only with the same model config, weights, language pair and, for
    many-to-many models, the same target-language tags and directions."""
    if payload["model_config"] != last["model_config"]:
        raise CheckpointError(f"{path} has another model config than {last_path}; cannot average")
    shapes = lambda p: {name: t.shape for name, t in p["model"].items()}  # noqa: E731
    if shapes(payload) != shapes(last):
        raise CheckpointError(f"{path} has other weights (names or shapes) than {last_path}; cannot average")
    pair, last_pair = language_pair(payload.get("train_config")), language_pair(last.get("train_config"))
    if not same_direction(pair, last_pair):
        raise CheckpointError(
            f"{path} translates {direction(pair)}, but {last_path} translates {direction(last_pair)}; cannot average"
        )
    tags, last_tags = tokenizer_of(payload, path).target_tags, tokenizer_of(last, last_path).target_tags
    if tags != last_tags:
        have = lambda t: ", ".join(sorted(t)) or "none"  # noqa: E731
        raise CheckpointError(f"{path} has target-language tags {have(tags)}, but {last_path} has {have(last_tags)}; cannot average")  # fmt: skip
    ways, last_ways = directions_of(payload.get("train_config")), directions_of(last.get("train_config"))
    if ways != last_ways:
        raise CheckpointError(f"{path} was trained on directions {ways}, but {last_path} on {last_ways}; cannot average")  # fmt: skip


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer, dict]:
    """Model (in eval mode), tokenizer and the raw payload of a checkpoint."""
    payload = load(path, device)
    try:
        with initialization_skipped():  # every weight comes from the file (load_state_dict is strict)
            model = Transformer(ModelConfig(**payload["model_config"])).to(device)
    except (TypeError, ValueError, AttributeError) as e:  # unknown keys, values of the wrong type or range
        raise CheckpointError(f"{path} has a bad model_config: {first_line(e)}") from None
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as e:  # missing, unexpected or differently shaped weights
        raise CheckpointError(f"{path}: its weights do not fit its model_config ({first_line(e, skip=1)})") from None
    tokenizer = tokenizer_of(payload, path)
    check_vocabulary(path, model.cfg, tokenizer)
    return model.eval(), tokenizer, payload


@contextlib.contextmanager
def initialization_skipped():
    """torch.nn.init's functions leave their tensor as it is while the block runs: a model built
    only to be given a checkpoint's weights skips drawing random ones (0.06 s of a one-sentence
    translate.py for the recipe's model). Its non-persistent buffers (position tables) are still
    computed, as they are not drawn by torch.nn.init."""
    names = [name for name in dir(torch.nn.init) if name.endswith("_") and not name.startswith("_")]
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def check_vocabulary(path: Path, cfg: ModelConfig, tokenizer: Tokenizer) -> None:
    """The tokenizer in a checkpoint must be the one its model was built for."""
    for key, size, side in (("vocab_size", cfg.vocab_size, tokenizer), ("src_vocab_size", cfg.src_vocab_size, tokenizer.source)):  # fmt: skip
        if size is not None and size != len(side):
            raise CheckpointError(f"{path}: model_config {key}={size}, but its tokenizer has {len(side)} pieces")


def first_line(error: Exception, skip: int = 0, limit: int = 200) -> str:
    """A one-line summary of an exception's message (skipping `skip` header lines, when it has more)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    line = (lines[skip:] or lines or [type(error).__name__])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def language_pair(train_config: dict | None) -> tuple[tuple[str, ...], str] | None:
    """(source languages, target language) of a checkpoint's training run: data.src_lang first,
    then data.extra_src_langs (many-to-one), and data.tgt_lang; None when train_config lacks them."""
    data = train_config.get("data") if isinstance(train_config, dict) else None
    if not isinstance(data, dict) or not data.get("src_lang") or not data.get("tgt_lang") or data.get("directions"):
        return None  # a many-to-many run's are its directions
    return (data["src_lang"], *(data.get("extra_src_langs") or [])), data["tgt_lang"]


def directions_of(train_config: dict | None) -> list[str]:
    """The directions ("de-en") of a many-to-many training run (data.directions); [] for another."""
    data = train_config.get("data") if isinstance(train_config, dict) else None
    return [str(name) for name in data.get("directions") or []] if isinstance(data, dict) else []


def direction(pair: tuple[tuple[str, ...], str]) -> str:
    """A language pair as "de->en", or "de,fr->en" for a many-to-one model."""
    return f"{','.join(pair[0])}->{pair[1]}"


def same_direction(a, b) -> bool:
    """Two language pairs translate the same way: the same main source and the same target (or
    one of them is unknown)."""
    return a is None or b is None or (a[0][0], a[1]) == (b[0][0], b[1])


def train_config_of(payload: dict, path: Path) -> dict:
    """The training run's config saved in a checkpoint, for scripts that rebuild its data."""
    train_config = payload.get("train_config")
    if not isinstance(train_config, dict) or not isinstance(train_config.get("data"), dict):
        raise CheckpointError(f"{path} has no train_config with its training data settings, which this script needs")
    trainer = train_config.get("trainer", {})
    if "chunked_loss" in trainer:  # a checkpoint from before the option moved to runtime.chunked_loss
        runtime = train_config.get("runtime", {}) | {"chunked_loss": trainer["chunked_loss"]}
        trainer = {key: value for key, value in trainer.items() if key != "chunked_loss"}
        train_config = train_config | {"trainer": trainer, "runtime": runtime}
    return train_config
