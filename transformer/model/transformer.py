"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Read top to bottom: the configuration, the masks, the two layer kinds, the two stacks, and the
model that ties them together. Attention is in attention.py (its variants in
attention_variants.py); embeddings, positions, the feed-forward networks and Add & Norm are in
blocks.py. docs/MODEL.md follows the paper section by section through this code.

This is the reference: plain PyTorch modules, the same on every device. transformer/fast/ puts
faster equivalents in place on a built model (`accelerate`); this module never imports it.

Mask convention, used everywhere in this package: a boolean tensor where True means "this query
may attend to this key". Masks broadcast against attention scores of shape
(batch, heads, query_len, key_len); `padding_mask` and `causal_mask` build them.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .attention import MultiHeadAttention, Rotary
from .attention_variants import AttentionConfig, build_attention
from .blocks import (
    AddNorm,
    FeedForward,
    LearnedPositions,
    NoPositions,
    SinusoidalPositions,
    SwiGLUFeedForward,
    TokenEmbedding,
    make_norm,
    word_dropout,
)
from .cache import DecoderState, KeyValueCache, LayerCache

POSITIONAL_KINDS = ("sinusoidal", "learned", "rope")
NORM_KINDS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("relu", "gelu", "silu", "swiglu")
SINUSOIDAL_LAYOUTS = ("interleaved", "halves")


@dataclass
class ModelConfig:
    vocab_size: int = 8000  # the target (or joint) vocabulary; train.py sets it from the tokenizer
    _: KW_ONLY  # the rest by name: a field added later cannot shift the meaning of positional arguments
    src_vocab_size: Optional[int] = None  # None: the source shares the target's vocabulary and embedding
    pad_id: int = 0
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: Optional[int] = None  # None: = n_heads (MHA); 1: multi-query; between: grouped-query
    d_ff: int = 2048
    dropout: float = 0.1  # on embeddings and on every sublayer output before the residual add
    attention_dropout: float = 0.0  # on attention weights
    activation_dropout: float = 0.0  # inside the feed-forward network, after its activation
    word_dropout: float = 0.0  # whole input tokens of both sides in training: embedding zeroed, position kept
    bias: bool = True  # bias terms in the attention projections W_q, W_k, W_v, W_o
    norm_first: bool = False  # False: post-norm as in the paper; True: pre-norm
    positional: str = "sinusoidal"  # or "learned", or "rope" (rotary, inside self-attention)
    sinusoidal_layout: str = "interleaved"  # sines and cosines alternating (the paper), or "halves" (Marian)
    max_positions: int = 1024
    tie_output: bool = True  # output projection shares the embedding matrix
    output_bias: bool = False  # a bias added to the logits (Marian's), trained with the rest
    norm: str = "layernorm"  # or "rmsnorm"
    activation: str = "relu"  # or "gelu", "silu" (swish), or "swiglu" (gated; hidden size 2/3 d_ff, same parameters)
    attention: AttentionConfig = field(default_factory=AttentionConfig)  # the attention variant

    def __post_init__(self) -> None:
        if isinstance(self.attention, dict):  # from a checkpoint's plain-dict config
            self.attention = AttentionConfig(**self.attention)
        self.check_sizes()
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}")
        for key in ("dropout", "attention_dropout", "activation_dropout", "word_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:  # p = 1 would blank every activation it touches
                raise ValueError(f"model.{key}={getattr(self, key)} is not in [0, 1)")
        if self.positional not in POSITIONAL_KINDS:
            raise ValueError(f"model.positional={self.positional!r} is not one of {POSITIONAL_KINDS}")
        if self.norm not in NORM_KINDS:
            raise ValueError(f"model.norm={self.norm!r} is not one of {NORM_KINDS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation={self.activation!r} is not one of {ACTIVATIONS}")
        if self.sinusoidal_layout not in SINUSOIDAL_LAYOUTS:
            raise ValueError(f"model.sinusoidal_layout={self.sinusoidal_layout!r} is not one of {SINUSOIDAL_LAYOUTS}")
        self.attention.check(self.n_heads, self.d_model // self.n_heads)
        if self.positional == "rope" and self.head_size % 2:
            raise ValueError(f"model.positional=rope needs an even head size, got {self.head_size}")
        if self.positional == "sinusoidal" and self.d_model % 2:  # sines and cosines in pairs
            raise ValueError(f"model.positional=sinusoidal needs an even model.d_model, got {self.d_model}")

    def check_sizes(self) -> None:
        """Counts and sizes, before anything divides by them."""
        for key in ("vocab_size", "n_encoder_layers", "n_decoder_layers", "d_model", "n_heads", "d_ff"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
        for key in ("src_vocab_size", "n_kv_heads"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1 (or null)")
        if self.max_positions < 2:  # BOS and one token
            raise ValueError(f"model.max_positions={self.max_positions} must be >= 2")
        ids = min(self.vocab_size, self.src_vocab_size or self.vocab_size)  # of both vocabularies
        if not 0 <= self.pad_id < ids:
            raise ValueError(f"model.pad_id={self.pad_id} must be a token id, in 0..{ids - 1}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        """Features per head in the attention product (wider than d_model / n_heads with overlap)."""
        overlap = self.attention.overlap if self.attention.kind == "overlap" else 0
        return self.d_model // self.n_heads + 2 * overlap


def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """(batch, len) token ids -> (batch, 1, 1, len): True where the key is a real token."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(query_len: int, offset: int = 0, device: torch.device | None = None) -> Tensor:
    """(1, 1, query_len, offset + query_len): query i (at position offset + i) sees keys 0..offset + i."""
    query_pos = torch.arange(offset, offset + query_len, device=device)[:, None]
    key_pos = torch.arange(offset + query_len, device=device)[None, :]
    return (key_pos <= query_pos)[None, None]


# --- Layers -------------------------------------------------------------------------------------


def feed_forward(cfg: ModelConfig) -> nn.Module:
    if cfg.activation == "swiglu":
        return SwiGLUFeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
    return FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation)


def add_norm(cfg: ModelConfig) -> AddNorm:
    return AddNorm(cfg.d_model, cfg.dropout, cfg.norm_first, cfg.norm)


class EncoderLayer(nn.Module):
    """Self-attention over the source, then the feed-forward network; each wrapped in Add & Norm."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary | None = None):
        super().__init__()
        self.self_attn, self.self_attn_norm = build_attention(cfg, False, rotary), add_norm(cfg)
        self.ffn, self.ffn_norm = feed_forward(cfg), add_norm(cfg)

    def forward(self, x: Tensor, src_mask: Tensor, need_weights: bool = False) -> tuple[Tensor, dict]:
        h = self.self_attn_norm.before(x)
        h, self_weights = self.self_attn(h, h, src_mask, need_weights=need_weights)
        x = self.self_attn_norm.after(x, h)
        x = self.ffn_norm.after(x, self.ffn(self.ffn_norm.before(x)))
        return x, {"self": self_weights}


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to the encoder output (memory), feed-forward."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary | None = None):
        super().__init__()
        self.self_attn, self.self_attn_norm = build_attention(cfg, False, rotary), add_norm(cfg)
        self.cross_attn, self.cross_attn_norm = build_attention(cfg, True, None), add_norm(cfg)
        self.ffn, self.ffn_norm = feed_forward(cfg), add_norm(cfg)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        src_mask: Tensor,
        tgt_mask: Tensor | None,
        cache: LayerCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, dict]:
        """x: (rows, tgt_len, d_model) -> the same shape, and the attention weights if asked.
        With a cache, x holds only the new tokens and memory may be None once the cache holds
        the encoder's keys and values."""
        self_cache, cross_cache = (None, None) if cache is None else (cache.self, cache.cross)
        h = self.self_attn_norm.before(x)
        h, self_weights = self.self_attn(h, h, tgt_mask, self_cache, need_weights=need_weights)
        x = self.self_attn_norm.after(x, h)
        h = self.cross_attn_norm.before(x)
        h, cross_weights = self.attend_memory(h, memory, src_mask, cross_cache, need_weights)
        x = self.cross_attn_norm.after(x, h)
        x = self.ffn_norm.after(x, self.ffn(self.ffn_norm.before(x)))
        return x, {"self": self_weights, "cross": cross_weights}

    def attend_memory(self, query: Tensor, memory: Tensor | None, src_mask: Tensor, cache: KeyValueCache | None, need_weights: bool):  # fmt: skip
        """Cross-attention from the decoder's queries (rows, len, d_model) to the encoder output
        (sentences, src_len, d_model): one row per sentence, or in beam search k per sentence."""
        return self.cross_attn(query, memory, src_mask, cache, static_kv=True, need_weights=need_weights)


# --- Stacks and the model -----------------------------------------------------------------------


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.d_model, cfg.pad_id)  # both sides', unless:
        self.src_embed = None  # the source's own embedding, for a separate source vocabulary
        if cfg.src_vocab_size is not None:
            self.src_embed = TokenEmbedding(cfg.src_vocab_size, cfg.d_model, cfg.pad_id)
        rotary = None
        if cfg.positional == "rope":
            self.positions, rotary = NoPositions(), Rotary(cfg.head_size, cfg.max_positions)
        elif cfg.positional == "learned":
            self.positions = LearnedPositions(cfg.d_model, cfg.max_positions)
        else:
            self.positions = SinusoidalPositions(cfg.d_model, cfg.max_positions, cfg.sinusoidal_layout)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg, rotary) for _ in range(cfg.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.n_decoder_layers))
        # Pre-norm leaves the residual stream un-normalized, so each stack ends with a norm.
        self.encoder_norm = make_norm(cfg.norm, cfg.d_model) if cfg.norm_first else nn.Identity()
        self.decoder_norm = make_norm(cfg.norm, cfg.d_model) if cfg.norm_first else nn.Identity()
        self.output = None if cfg.tie_output else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.logits_bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.output_bias else None
        self.recompute = False  # set by the trainer (trainer.recompute): activation checkpointing per layer

    def run_layer(self, layer: nn.Module, *args):
        """layer(*args), or in training with recompute on, the same with its activations
        recomputed in the backward pass instead of stored (dropout masks are replayed)."""
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    def embed_tokens(self, tokens: Tensor, offset: int = 0, source: bool = False) -> Tensor:
        embed = self.src_embed if source and self.src_embed is not None else self.embed
        x = word_dropout(embed(tokens), self.cfg.word_dropout, self.training)
        return self.embed_dropout(self.positions(x, offset))

    def encode(self, src: Tensor, src_mask: Tensor, need_weights: bool = False) -> tuple[Tensor, list]:
        """src: (batch, src_len) -> memory (batch, src_len, d_model), per-layer attention weights."""
        x, weights = self.embed_tokens(src, source=True), []  # (batch, src_len, d_model)
        for layer in self.encoder_layers:
            x, w = self.run_layer(layer, x, src_mask, need_weights)
            weights.append(w)
        return self.encoder_norm(x), weights

    def new_state(self) -> DecoderState:
        """An empty incremental-decoding state (see transformer/decoding/)."""
        return DecoderState()

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_mask: Tensor,
        state: DecoderState | None = None,
        need_weights: bool = False,
        project: bool = True,
    ) -> tuple[Tensor, list]:
        """tgt: (batch, tgt_len) -> logits (batch, tgt_len, vocab), per-layer attention weights.

        With a `state`, tgt holds only the new tokens; earlier ones are read from the state.
        project=False returns the normalized decoder output instead of the logits, for a loss
        that applies `output_weight` itself (fast/loss.py's chunked loss).
        """
        offset = state.positions() if state is not None else 0  # an int, or (rows,) each row's own
        if state is not None and not state.layers:
            state.start(len(self.decoder_layers))
        tgt_mask = causal_mask(tgt.size(1), offset, tgt.device) if tgt.size(1) > 1 else None
        x, weights = self.embed_tokens(tgt, offset), []
        for i, layer in enumerate(self.decoder_layers):
            layer_state = state.layers[i] if state is not None else None
            if layer_state is None:
                x, w = self.run_layer(layer, x, memory, src_mask, tgt_mask, None, need_weights)
            else:
                x, w = layer(x, memory, src_mask, tgt_mask, layer_state, need_weights)
            weights.append(w)
        if state is not None:
            state.advance(tgt.size(1))
        x = self.decoder_norm(x)
        return (self.project(x) if project else x), weights

    def project(self, x: Tensor) -> Tensor:
        """(batch, len, d_model) -> logits (batch, len, vocab)"""
        logits = F.linear(x, self.embed.embed.weight) if self.output is None else self.output(x)
        return logits if self.logits_bias is None else logits + self.logits_bias

    def vocabulary_projection(self, ids: Tensor):
        """The output projection cut to the target ids `ids` (u,): a function (batch, len, d_model)
        -> (batch, len, u) logits, the columns `ids` of `project`'s (a lexical shortlist's,
        decoding/shortlist.py). Made once per batch of sentences."""
        weight, bias = self.vocabulary_rows(ids)
        return lambda x: F.linear(x, weight, bias)

    def vocabulary_rows(self, ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """The output weight's rows `ids` (u, d_model) and the logits bias's entries (u,), if any."""
        bias = None if self.logits_bias is None else self.logits_bias.detach().index_select(0, ids)
        return self.output_weight.detach().index_select(0, ids), bias

    @property
    def output_weight(self) -> Tensor:
        """The output projection's (vocab, d_model) weight: the embedding's when tied."""
        return self.embed.embed.weight if self.output is None else self.output.weight

    def forward(self, src: Tensor, tgt: Tensor, project: bool = True) -> Tensor:
        """Teacher forcing: src (batch, src_len), tgt (batch, tgt_len) starting with BOS -> logits
        (or, with project=False, the decoder output the logits are projected from)."""
        src_mask = padding_mask(src, self.cfg.pad_id)
        memory, _ = self.encode(src, src_mask)
        return self.decode(tgt, memory, src_mask, project=project)[0]

    def attention_modules(self) -> dict[str, list[MultiHeadAttention]]:
        return {
            "encoder_self": [layer.self_attn for layer in self.encoder_layers],
            "decoder_self": [layer.self_attn for layer in self.decoder_layers],
            "cross": [layer.cross_attn for layer in self.decoder_layers],
        }

    def auxiliary_loss(self) -> Tensor | None:
        """The load-balancing losses (`balance_loss`, e.g. MoH's) of the last training forward
        pass, weighted by model.attention.balance_weight and summed over layers; None if none."""
        losses = [m.balance_loss for m in self.modules() if getattr(m, "balance_loss", None) is not None]
        for m in self.modules():
            if hasattr(m, "balance_loss"):
                m.balance_loss = None
        if not losses:
            return None
        return self.cfg.attention.balance_weight * torch.stack(losses).sum()

    def set_dropout(self, p: float) -> None:
        """Change the dropout on the embeddings and every sublayer output of the built model, as
        the trainer does when the budget's length chooses it (training/plan.py). `cfg.dropout`
        keeps model.dropout as configured: it is what a checkpoint's model config saves."""
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout {p} is not in [0, 1)")
        self.embed_dropout.p = p
        for module in self.modules():
            if isinstance(module, AddNorm):
                module.dropout.p = p

    def set_head_mask(self, masks: dict[str, Tensor] | None) -> None:
        """Scale each head's output at inference (1 keeps a head, 0 removes it); weights untouched.

        masks maps "encoder_self", "decoder_self" or "cross" to a (layers, heads) tensor;
        kinds left out, or masks=None, use every head.
        """
        for kind, modules in self.attention_modules().items():
            for i, attn in enumerate(modules):
                attn.head_mask = masks[kind][i] if masks is not None and kind in masks else None

    def attention_weights(self, src: Tensor, tgt: Tensor) -> dict[str, list[Tensor]]:
        """Every head's attention, each (batch, heads, query_len, key_len), one tensor per layer."""
        src_mask = padding_mask(src, self.cfg.pad_id)
        memory, enc = self.encode(src, src_mask, need_weights=True)
        _, dec = self.decode(tgt, memory, src_mask, need_weights=True)
        return {
            "encoder_self": [w["self"] for w in enc],
            "decoder_self": [w["self"] for w in dec],
            "cross": [w["cross"] for w in dec],
        }


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
