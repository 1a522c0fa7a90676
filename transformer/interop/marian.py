"""Import a MarianMT model (OPUS-MT) saved by Hugging Face transformers into this toolkit's model.

A Marian model is the paper's post-norm Transformer with a few choices of its own, each an
ordinary option of ModelConfig: the SiLU ("swish") activation, sinusoidal positions with the
sines in the first half of the features and the cosines in the second (sinusoidal_layout=halves),
a bias on the logits (output_bias) and embeddings scaled by sqrt(d_model) as ours are. Its
tokenizer is two SentencePiece models, one per side, whose pieces vocab.json numbers in one
shared table (a `Vocabulary`): ids 0 and 1 are </s> and <unk>, the last is <pad>, from which the
decoder starts (decoder_start_token_id). The directory is what `save_pretrained` writes:
config.json, model.safetensors (or pytorch_model.bin), source.spm, target.spm, vocab.json.

`read_marian(directory)` returns the model and tokenizer; anything it cannot represent exactly
is refused with a DataError naming the file and key.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from torch import Tensor

from ..checkpoint import code_it_would_run
from ..data.tokenizer import Tokenizer, Vocabulary
from ..errors import DataError
from ..model import ModelConfig, Transformer

ACTIVATIONS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu"}  # Hugging Face's name -> ours
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def read_marian(directory: Path) -> tuple[Transformer, Tokenizer, dict]:
    """(model in eval mode, tokenizer, what the directory says of itself: languages, name)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"path={directory} is not a directory")
    config = read_json(directory / "config.json")
    tokenizer = read_tokenizer(directory, config)
    model = Transformer(model_config(config, directory / "config.json", len(tokenizer)))
    model.load_state_dict(our_weights(read_weights(directory), model, directory))
    return model.eval(), tokenizer, describe(directory, config)


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


# --- The model config -----------------------------------------------------------------------------


def model_config(config: dict, path: Path, vocab_size: int) -> ModelConfig:
    """Our ModelConfig for a Marian config.json; what ours cannot express is refused by key."""
    check_representable(config, path, vocab_size)
    try:
        return ModelConfig(
            config["vocab_size"],
            pad_id=config["pad_token_id"],
            n_encoder_layers=config["encoder_layers"],
            n_decoder_layers=config["decoder_layers"],
            d_model=config["d_model"],
            n_heads=config["encoder_attention_heads"],
            d_ff=config["encoder_ffn_dim"],
            dropout=float(config.get("dropout", 0.1)),
            attention_dropout=float(config.get("attention_dropout", 0.0)),
            activation_dropout=float(config.get("activation_dropout", 0.0)),
            norm_first=False,
            positional="sinusoidal",
            sinusoidal_layout="halves",
            max_positions=config.get("max_position_embeddings", 1024),
            tie_output=config.get("tie_word_embeddings", True),
            output_bias=True,
            activation=ACTIVATIONS[config.get("activation_function", "gelu")],
        )
    except KeyError as e:
        raise DataError(f"{path} lacks the key {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise DataError(f"{path}: {e}") from None


def check_representable(config: dict, path: Path, vocab_size: int) -> None:
    """Refuse, naming the key, a Marian model that our Transformer would not compute exactly."""
    if config.get("model_type") != "marian":
        raise DataError(f"{path}: model_type={config.get('model_type')!r}, not a Marian model")
    needs = {
        "share_encoder_decoder_embeddings": (True, "separate source and target vocabularies are not supported"),
        "scale_embedding": (True, "unscaled embeddings are not supported (ours are scaled by sqrt(d_model))"),
        "normalize_before": (False, "pre-norm Marian models are not supported"),
        "normalize_embedding": (False, "a norm after the embeddings is not supported"),
        "add_final_layer_norm": (False, "a final layer norm is not supported"),
        "static_position_embeddings": (True, "learned positions are not supported"),
    }
    defaults = {"share_encoder_decoder_embeddings": True, "scale_embedding": False, "static_position_embeddings": True}
    for key, (wanted, why) in needs.items():
        if config.get(key, defaults.get(key, wanted)) != wanted:
            raise DataError(f"{path}: {key}={json.dumps(config.get(key))}: {why}")
    for ours, encoder_key, decoder_key in (("n_heads", "encoder_attention_heads", "decoder_attention_heads"), ("d_ff", "encoder_ffn_dim", "decoder_ffn_dim")):  # fmt: skip
        if config.get(encoder_key) != config.get(decoder_key):
            raise DataError(f"{path}: {encoder_key} != {decoder_key}; ours has one {ours} for both stacks")
    activation = config.get("activation_function", "gelu")
    if activation not in ACTIVATIONS:
        raise DataError(f"{path}: activation_function={activation!r} is not one of {sorted(ACTIVATIONS)}")
    if config.get("vocab_size") != vocab_size:
        raise DataError(f"{path}: vocab_size={config.get('vocab_size')}, but vocab.json has {vocab_size} pieces")
    decoder_vocab = config.get("decoder_vocab_size")
    if decoder_vocab not in (None, vocab_size):
        raise DataError(f"{path}: decoder_vocab_size={decoder_vocab} differs from vocab_size={vocab_size}")


# --- The tokenizer --------------------------------------------------------------------------------


def read_tokenizer(directory: Path, config: dict) -> Tokenizer:
    """The two SentencePiece models and vocab.json as one Tokenizer with a shared Vocabulary."""
    if (directory / "target_vocab.json").exists():
        raise DataError(f"{directory / 'target_vocab.json'}: separate target vocabularies are not supported")
    vocab_path = directory / "vocab.json"
    mapping = read_json(vocab_path)
    pieces = pieces_by_id(mapping, vocab_path)
    ids = special_ids(config, mapping, directory / "config.json")
    spm_models = []
    for name in ("source.spm", "target.spm"):
        if not (directory / name).is_file():
            raise DataError(f"{directory / name} does not exist")
        spm_models.append((directory / name).read_bytes())
    try:
        return Tokenizer(spm_models[1], spm_models[0], Vocabulary(tuple(pieces), **ids))
    except DataError as e:
        raise DataError(f"{directory}: {e}") from None


def pieces_by_id(mapping: dict, path: Path) -> list[str]:
    """vocab.json's {piece: id} as a list indexed by id; its ids must be 0..n-1, each once."""
    if not all(isinstance(i, int) for i in mapping.values()):
        raise DataError(f"{path}: every id must be an integer")
    by_id = {i: piece for piece, i in mapping.items()}
    if sorted(by_id) != list(range(len(mapping))):
        raise DataError(f"{path}: the ids are not 0..{len(mapping) - 1}, each once")
    return [by_id[i] for i in range(len(mapping))]


def special_ids(config: dict, mapping: dict, path: Path) -> dict:
    """pad, unk, eos and the decoder's start token, from config.json (unk from vocab.json)."""
    if "<unk>" not in mapping:
        raise DataError(f"{path.with_name('vocab.json')} has no <unk> piece")
    ids = {"unk_id": mapping["<unk>"]}
    for ours, key in (("pad_id", "pad_token_id"), ("eos_id", "eos_token_id"), ("bos_id", "decoder_start_token_id")):
        value = config.get(key)
        if not isinstance(value, int):
            raise DataError(f"{path}: {key}={json.dumps(value)} is not one token id")
        ids[ours] = value
    return ids


# --- The weights ----------------------------------------------------------------------------------


def read_weights(directory: Path) -> dict[str, Tensor]:
    """The state dict in model.safetensors (one file or shards listed in its index) or pytorch_model.bin."""
    for name in WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if name.endswith(".index.json"):
            shards = sorted(set(read_json(path).get("weight_map", {}).values()))
            return {k: v for shard in shards for k, v in read_safetensors(directory / shard).items()}
        return read_safetensors(path) if name.endswith(".safetensors") else read_torch(path)
    raise DataError(f"{directory} has no weights (none of {', '.join(WEIGHT_FILES)})")


def read_safetensors(path: Path) -> dict[str, Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise DataError(f"reading {path} needs the safetensors package: pip install safetensors") from None
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors reports a damaged file in its own exception types
        raise DataError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def read_torch(path: Path) -> dict[str, Tensor]:
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch's message advises loading it unsafely: not repeated here
        code = code_it_would_run(e)
        if code:
            raise DataError(f"{path} was refused as unsafe: it asks to run code when loaded ({code}), which no state dict of tensors does; use the model's model.safetensors instead") from None  # fmt: skip
        raise DataError(f"{path} is not a PyTorch state dict of tensors (the safe loader cannot read it)") from None
    except Exception as e:  # a damaged file fails inside the unpickler in many ways
        raise DataError(f"{path} is not a readable PyTorch file ({type(e).__name__}: {e})") from None
    if not isinstance(weights, dict) or not all(isinstance(t, Tensor) for t in weights.values()):
        raise DataError(f"{path} is not a state dict of tensors")
    return weights


LAYER_NAMES = {  # ours -> Hugging Face's, inside one layer
    "self_attn.w_q": "self_attn.q_proj",
    "self_attn.w_k": "self_attn.k_proj",
    "self_attn.w_v": "self_attn.v_proj",
    "self_attn.w_o": "self_attn.out_proj",
    "self_attn_norm.norm": "self_attn_layer_norm",
    "cross_attn.w_q": "encoder_attn.q_proj",
    "cross_attn.w_k": "encoder_attn.k_proj",
    "cross_attn.w_v": "encoder_attn.v_proj",
    "cross_attn.w_o": "encoder_attn.out_proj",
    "cross_attn_norm.norm": "encoder_attn_layer_norm",
    "ffn.linear1": "fc1",
    "ffn.linear2": "fc2",
    "ffn_norm.norm": "final_layer_norm",
}
EMBEDDING_NAMES = ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")


def hf_name(ours: str) -> str:
    """The Hugging Face name of one of our layer weights, e.g. encoder_layers.0.ffn.linear1.bias ->
    model.encoder.layers.0.fc1.bias."""
    stack, index, rest = ours.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    return f"model.{stack.removesuffix('_layers')}.layers.{index}.{LAYER_NAMES[module]}.{kind}"


def our_weights(hf: dict[str, Tensor], model: Transformer, directory: Path) -> dict[str, Tensor]:
    """Our state dict from Hugging Face's: every one of our weights found, with its shape."""
    hf = {name.removeprefix("base_model."): t for name, t in hf.items()}
    embedding = next((name for name in EMBEDDING_NAMES if name in hf), None)
    if embedding is None:
        raise DataError(f"{directory}: the weights have no token embedding ({EMBEDDING_NAMES[0]})")
    out = {}
    for name, ours in model.state_dict().items():
        if name == "embed.embed.weight":
            source = embedding
        elif name == "logits_bias":
            source = "final_logits_bias"
        elif name == "output.weight":
            source = "lm_head.weight"
        else:
            source = hf_name(name)
        if source not in hf:
            raise DataError(f"{directory}: the weights lack {source}")
        tensor = hf[source].reshape(-1) if name == "logits_bias" else hf[source]
        if tensor.shape != ours.shape:
            raise DataError(f"{directory}: {source} has shape {tuple(tensor.shape)}, expected {tuple(ours.shape)}")
        out[name] = tensor.to(ours.dtype)
    check_positions(hf, model, directory)
    return out


def check_positions(hf: dict[str, Tensor], model: Transformer, directory: Path) -> None:
    """A saved sinusoidal table (older files hold one) must be the one we compute."""
    for name in ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"):
        if name in hf:
            table = model.positions.table
            saved = hf[name][: table.size(0)].float()
            if saved.shape != table[: saved.size(0)].shape or not torch.allclose(saved, table[: saved.size(0)], atol=1e-4):  # fmt: skip
                raise DataError(f"{directory}: {name} is not the sinusoidal table of Marian's layout")


def describe(directory: Path, config: dict) -> dict:
    """What to record of the source: the directory, its name and languages if it says them."""
    tokenizer_config = directory / "tokenizer_config.json"
    languages = read_json(tokenizer_config) if tokenizer_config.is_file() else {}
    return {
        "path": str(directory),
        "name": config.get("_name_or_path") or directory.name,
        "source_lang": languages.get("source_lang"),
        "target_lang": languages.get("target_lang"),
    }
