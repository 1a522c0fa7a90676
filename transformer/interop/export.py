"""Export a trained model to CTranslate2 (https://github.com/OpenNMT/CTranslate2), a C++ inference
engine with int8 and bf16 CPU kernels, and decode with it under our decoding settings.

`build_spec` describes the model with CTranslate2's model-spec API, layer by layer: the weights
are ours, unchanged (our own sinusoidal table, in either layout, is exported as a position table,
since CTranslate2's built-in one orders sines and cosines differently), the logits bias too.
An imported Marian model keeps its `<pad>` token, which its decoder starts from (as in Hugging
Face's MarianMT; CTranslate2's own Marian converter drops it and starts from a zero embedding). `export` writes the directory that
`ctranslate2.Translator(DIR)` loads, with the SentencePiece model(s) and a usage note beside it.
`translate_ids` decodes token ids with a loaded Translator under a DecodeConfig, with the settings
that make CTranslate2 search as our decoding does (see `search_options`).

ctranslate2 is an optional dependency (`pip install -e .[export]`); it is imported when used.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..data.tokenizer import Tokenizer
from ..errors import ConfigError
from ..model import ModelConfig, Transformer

if TYPE_CHECKING:
    from ..decoding import DecodeConfig

QUANTIZATIONS = ("float32", "int8", "int8_float32", "bfloat16")
SOURCE_MODEL, TARGET_MODEL = "spm.src.model", "spm.model"  # a joint vocabulary has spm.model alone
VOCABULARY_MAP = "vmap.txt"  # CTranslate2 reads a vocabulary map under this name


def require_ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise ConfigError("exporting needs the ctranslate2 package: pip install -e '.[export]'") from None
    return ctranslate2


def check_exportable(cfg: ModelConfig) -> None:
    """Refuse, naming the option, a model that CTranslate2's Transformer cannot express."""
    if cfg.attention.kind != "standard":
        raise ConfigError(
            f"model.attention.kind={cfg.attention.kind} cannot be exported: CTranslate2 has standard "
            "multi-head attention only (with grouped-query or multi-query key/value heads)"
        )


# --- The model spec -----------------------------------------------------------------------------


def build_spec(model: Transformer, tokenizer: Tokenizer):
    """A ctranslate2.specs.TransformerSpec holding `model`'s weights and `tokenizer`'s vocabularies."""
    ct2 = require_ctranslate2()
    cfg = model.cfg
    check_exportable(cfg)
    specs = ct2.specs
    options = dict(
        num_heads=cfg.n_heads,
        pre_norm=cfg.norm_first,
        activation=activation(specs, cfg.activation),
        ffn_glu=cfg.activation == "swiglu",
        rms_norm=cfg.norm == "rmsnorm",
        num_heads_kv=cfg.kv_heads if cfg.kv_heads != cfg.n_heads else None,
    )
    if cfg.positional == "rope":  # every feature of a head, rotated in pairs (x_2i, x_2i+1)
        options.update(rotary_dim=0, rotary_interleave=True, rotary_base=10000)
    encoder = specs.TransformerEncoderSpec(cfg.n_encoder_layers, **options)
    decoder = specs.TransformerDecoderSpec(cfg.n_decoder_layers, **options)
    spec = specs.TransformerSpec(encoder, decoder)
    fill_encoder(encoder, model)
    fill_decoder(decoder, model)
    source, target = tokenizer.source, tokenizer
    spec.register_source_vocabulary(pieces(source))
    spec.register_target_vocabulary(pieces(target))
    set_config(spec.config, model, target)
    return spec


def activation(specs, name: str):
    kinds = {
        "relu": specs.Activation.RELU,
        "gelu": specs.Activation.GELU,
        "silu": specs.Activation.SWISH,
        "swiglu": specs.Activation.SWISH,
    }
    return kinds[name]  # F.gelu is the exact (erf) GELU; SiLU, and SwiGLU's gate, are CTranslate2's SWISH


def pieces(tokenizer: Tokenizer) -> list[str]:
    return [tokenizer.id_to_piece(i) for i in range(len(tokenizer))]


def set_config(config, model: Transformer, tokenizer: Tokenizer) -> None:
    """Special tokens by name, the source's EOS (our encoder reads one), the norms' epsilon. The
    decoder starts from our BOS (an imported Marian model's: its padding token)."""
    piece = tokenizer.id_to_piece
    config.unk_token, config.bos_token, config.eos_token = piece(tokenizer.unk_id), piece(tokenizer.bos_id), piece(tokenizer.eos_id)  # fmt: skip
    config.decoder_start_token = piece(tokenizer.bos_id)
    config.add_source_eos = True
    norm = model.encoder_layers[0].self_attn_norm.norm
    config.layer_norm_epsilon = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps


def weight(t: Tensor) -> Tensor:
    """A float32 CPU copy, never a view: spec.optimize(quantization="int8") scales the spec's arrays
    in place as it quantizes them, and through a view would scale the exported model's own weights."""
    return t.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()


def set_linear(spec, *linears: nn.Linear) -> None:
    """One CTranslate2 linear layer from one or more of ours stacked along the outputs (W_q, W_k, W_v)."""
    spec.weight = weight(torch.cat([linear.weight for linear in linears]))
    if linears[0].bias is not None:
        spec.bias = weight(torch.cat([linear.bias for linear in linears]))


def set_norm(spec, norm: nn.Module) -> None:
    spec.gamma = weight(norm.weight)
    if isinstance(norm, nn.LayerNorm):
        spec.beta = weight(norm.bias)


def set_attention(spec, attn, norm: nn.Module, cross: bool) -> None:
    """Self-attention is [W_q; W_k; W_v] then W_o; cross-attention is W_q, [W_k; W_v], W_o. The
    norm is the sublayer's Add & Norm one: CTranslate2 applies it before (pre-norm) or after it."""
    set_norm(spec.layer_norm, norm)
    if cross:
        set_linear(spec.linear[0], attn.w_q)
        set_linear(spec.linear[1], attn.w_k, attn.w_v)
    else:
        set_linear(spec.linear[0], attn.w_q, attn.w_k, attn.w_v)
    set_linear(spec.linear[-1], attn.w_o)


def set_ffn(spec, ffn: nn.Module, norm: nn.Module) -> None:
    set_norm(spec.layer_norm, norm)
    if hasattr(ffn, "gate_up"):  # SwiGLU: linear_0 is activated (the gate), linear_0_noact is not (up)
        gate, up = ffn.gate_up.weight.chunk(2)
        spec.linear_0.weight, spec.linear_0_noact.weight = weight(gate), weight(up)
        set_linear(spec.linear_1, ffn.down)
    else:
        set_linear(spec.linear_0, ffn.linear1)
        set_linear(spec.linear_1, ffn.linear2)


def set_positions(spec, model: Transformer) -> None:
    """Our position table, added to the scaled embeddings (rotary positions have none)."""
    if model.cfg.positional == "sinusoidal":
        spec.position_encodings.encodings = weight(model.positions.table)
    elif model.cfg.positional == "learned":
        spec.position_encodings.encodings = weight(model.positions.embed.weight)


def fill_encoder(spec, model: Transformer) -> None:
    embed = model.src_embed if model.src_embed is not None else model.embed
    spec.embeddings[0].weight = weight(embed.embed.weight)  # spec.scale_embeddings: times sqrt(d_model), as ours
    set_positions(spec, model)
    for layer_spec, layer in zip(spec.layer, model.encoder_layers):
        set_attention(layer_spec.self_attention, layer.self_attn, layer.self_attn_norm.norm, cross=False)
        set_ffn(layer_spec.ffn, layer.ffn, layer.ffn_norm.norm)
    if model.cfg.norm_first:
        set_norm(spec.layer_norm, model.encoder_norm)


def fill_decoder(spec, model: Transformer) -> None:
    spec.embeddings.weight = weight(model.embed.embed.weight)
    set_positions(spec, model)
    for layer_spec, layer in zip(spec.layer, model.decoder_layers):
        set_attention(layer_spec.self_attention, layer.self_attn, layer.self_attn_norm.norm, cross=False)
        set_attention(layer_spec.attention, layer.cross_attn, layer.cross_attn_norm.norm, cross=True)
        set_ffn(layer_spec.ffn, layer.ffn, layer.ffn_norm.norm)
    if model.cfg.norm_first:
        set_norm(spec.layer_norm, model.decoder_norm)
    spec.projection.weight = weight(model.output_weight)  # tied: the embedding matrix, unscaled
    if model.logits_bias is not None:
        spec.projection.bias = weight(model.logits_bias)


# --- Writing the directory ----------------------------------------------------------------------


def check_output_dir(path: str | Path, overwrite: bool) -> Path:
    """The export directory: new, empty, or (overwrite=true) one to replace; never a file."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output={path} is an existing file; give a directory path")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ConfigError(f"output={path} is a non-empty directory; choose another or pass overwrite=true")
    if not path.parent.is_dir():
        raise ConfigError(f"output={path}: the directory {path.parent} does not exist")
    return path


def export(model: Transformer, tokenizer: Tokenizer, output: Path, quantization: str, note: str = "", shortlist: Path | None = None) -> None:  # fmt: skip
    """Write the CTranslate2 model directory `output` (checked by check_output_dir): built in a
    temporary directory beside it and renamed into place, so a failure leaves nothing half-written.
    A `shortlist` (decoding/shortlist.py) goes in as the vocabulary map, vmap.txt (use_vmap=True)."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization={quantization} is not one of {QUANTIZATIONS}")
    spec = build_spec(model, tokenizer)
    spec.validate()
    spec.optimize(quantization=quantization)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        spec.save(str(tmp))
        (tmp / TARGET_MODEL).write_bytes(tokenizer.model_bytes)
        if tokenizer.source_bytes is not None:  # a separate vocabulary, or an imported model's source model
            (tmp / SOURCE_MODEL).write_bytes(tokenizer.source_bytes)
        if shortlist is not None:
            shutil.copyfile(shortlist, tmp / VOCABULARY_MAP)
        (tmp / "README.md").write_text(usage_note(tokenizer, quantization, note, shortlist is not None))
        replace_dir(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(new: Path, output: Path) -> None:
    """Move `new` to `output`; an existing `output` is first moved aside, then removed."""
    old = None
    if output.exists():
        old = output.with_name(f".{output.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        output.rename(old)
    new.rename(output)
    if old is not None:
        shutil.rmtree(old)


def source_model(tokenizer: Tokenizer) -> str:
    """The file name of the SentencePiece model an export's sources are cut with (its own where the
    source side has one, else the joint model)."""
    return TARGET_MODEL if tokenizer.source_bytes is None else SOURCE_MODEL


def usage_note(tokenizer: Tokenizer, quantization: str, note: str, vmap: bool = False) -> str:
    source = source_model(tokenizer)
    pad, start = tokenizer.id_to_piece(tokenizer.pad_id), tokenizer.id_to_piece(tokenizer.bos_id)
    tags = {lang: tokenizer.source.id_to_piece(i) for lang, i in sorted(tokenizer.target_tags.items())}
    tag = next(iter(tags.values()), "")
    pieces = f'[["{tag}"] + p for p in src.encode(["Ein Hund rennt."], out_type=str)]' if tags else 'src.encode(["Ein Hund rennt."], out_type=str)'  # fmt: skip
    many = f"""
A many-to-many model: every source starts with the tag of the language to translate into, one
source token ({", ".join(f"`{t}` {lang}" for lang, t in tags.items())}), as translate.py tgt_lang= adds it.
""" if tags else ""  # fmt: skip
    return f"""# A CTranslate2 model exported by scripts/export_ctranslate2.py

{note}Weights: {quantization}. Source pieces come from `{source}`, target pieces decode with `{TARGET_MODEL}`;
the source's end-of-sentence token is added by CTranslate2 (add_source_eos), and decoding starts
from `{start}`.
{many}
```python
import ctranslate2, sentencepiece as spm
translator = ctranslate2.Translator("THIS_DIR", device="cpu", compute_type="default")  # or "int8"
src, tgt = spm.SentencePieceProcessor("THIS_DIR/{source}"), spm.SentencePieceProcessor("THIS_DIR/{TARGET_MODEL}")
pieces = {pieces}
results = translator.translate_batch(pieces, beam_size=5, max_decoding_length=64, min_decoding_length=0,
                                     length_penalty=0, suppress_sequences=[["{pad}"]])
print(tgt.decode(results[0].hypotheses[0]))
```

{VMAP_NOTE if vmap else ""}Decoding as our `translate.py` does, up to length normalization: `transformer.interop.export.translate_ids`.
CTranslate2 divides a beam's log-probability by length ** length_penalty, not by GNMT's
((5 + length) / 6) ** alpha; at 0 both rank by log-probability alone.
"""


# --- Decoding with CTranslate2 under our settings -------------------------------------------------


VMAP_NOTE = f"""The lexical shortlist of the checkpoint's run (scripts/build_shortlist.py) is `{VOCABULARY_MAP}`:
`translate_batch(..., use_vmap=True)` restricts each batch's output layer to it, as our
`decode.shortlist=true` does.

"""


def search_options(cfg: DecodeConfig, pad_piece: str) -> dict:
    """translate_batch options that search as our decoding does: greedy is beam 1, no minimum
    length unless decode.min_len asks, padding never generated, no input truncation. Length
    penalties differ in form (see usage_note); decode.length_penalty is passed as CTranslate2's."""
    beam = cfg.beam_size if cfg.strategy == "beam" else 1
    return dict(
        beam_size=beam,
        num_hypotheses=1,
        length_penalty=cfg.length_penalty if beam > 1 else 0.0,
        min_decoding_length=cfg.min_len,
        suppress_sequences=[[pad_piece]],
        max_input_length=0,
        use_vmap=cfg.shortlist,
    )


def length_limits(sources: list[list[int]], cfg: DecodeConfig, max_positions: int) -> list[int]:
    """Each token-id source's limit on output tokens, EOS included, as decoding.processors.max_lengths
    computes it (n counts the source's EOS), at least 2 for CTranslate2."""
    lengths = torch.tensor([len(s) + 1 for s in sources])
    return (lengths * cfg.max_len_a + cfg.max_len_b).long().clamp(min=2, max=max_positions - 1).tolist()


def translate_ids(translator, tokenizer: Tokenizer, sources: list[list[int]], cfg: DecodeConfig, max_positions: int):
    """Our decoding's output token ids (no BOS/EOS) for token-id `sources`, by a ctranslate2.Translator.

    Our length limit is per sentence (decode.max_len_a * n + max_len_b tokens, EOS included, where
    n counts the source's EOS); CTranslate2 takes one limit per call, without the EOS, so the
    sentences are grouped by their limit."""
    if cfg.strategy not in ("greedy", "beam"):
        raise ConfigError(f"decode.strategy={cfg.strategy} is not supported with CTranslate2 here (greedy, beam)")
    options = search_options(cfg, tokenizer.id_to_piece(tokenizer.pad_id))
    limits = length_limits(sources, cfg, max_positions)
    source_piece, target_id = tokenizer.source.id_to_piece, tokenizer.piece_to_id
    out: list[list[int]] = [[] for _ in sources]
    for limit in sorted(set(limits)):
        group = [i for i, n in enumerate(limits) if n == limit]
        batch = [[source_piece(t) for t in sources[i]] for i in group]
        results = translator.translate_batch(batch, max_decoding_length=limit - 1, **options)
        for i, result in zip(group, results):
            out[i] = [target_id(p) for p in result.hypotheses[0]]
    return out
