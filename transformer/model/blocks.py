"""The pieces of a Transformer layer around attention: token embeddings (and word dropout), the
three ways of giving positions, the position-wise feed-forward networks and Add & Norm (residual
connection plus LayerNorm or RMSNorm). model.py assembles them; attention is in attention.py."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# --- Embeddings and positions -------------------------------------------------------------------


def rows_at(table: Tensor, offset: int | Tensor, length: int) -> Tensor:
    """The rows of a per-position table for `length` tokens from `offset`: (length, features) for
    one int offset, or (batch, length, features) for a (batch,) tensor of each row's own offset."""
    if isinstance(offset, int):
        return table[offset : offset + length]
    return table[offset[:, None] + torch.arange(length, device=offset.device)]


class TokenEmbedding(nn.Module):
    """Token ids -> vectors scaled by sqrt(d_model), so they are not drowned by the positions."""

    def __init__(self, vocab_size: int, d_model: int, pad_id: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        nn.init.normal_(self.embed.weight, std=d_model**-0.5)
        nn.init.zeros_(self.embed.weight[pad_id])
        self.scale = math.sqrt(d_model)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embed(tokens) * self.scale


def word_dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """x (batch, length, features) with each position's whole vector zeroed with probability p and
    the kept ones scaled by 1 / (1 - p).

    Applied to token embeddings before positions are added, the model is told that a word is
    there but not which one, and must guess it from its context: a regularizer for small corpora
    (word dropout; Sennrich and Zhang, 2019, used it for low-resource translation)."""
    if not training or p == 0.0:
        return x
    return x * F.dropout(x.new_ones(*x.shape[:-1], 1), p)


class SinusoidalPositions(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), added to the embeddings.

    layout="halves" puts the same sines in the first d/2 features and the cosines in the last
    d/2 (Marian's layout, which its trained models expect); "interleaved" is the paper's."""

    def __init__(self, d_model: int, max_positions: int, layout: str = "interleaved"):
        super().__init__()
        # In float64, then rounded: in float32 the angles of late positions lose digits (pos * inv_freq).
        pos = torch.arange(max_positions, dtype=torch.float64)[:, None]
        inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
        sines, cosines = torch.sin(pos * inv_freq), torch.cos(pos * inv_freq)  # (max_positions, d_model / 2)
        if layout == "halves":
            table = torch.cat([sines, cosines], dim=1)
        else:
            table = torch.stack([sines, cosines], dim=2).flatten(1)  # sin, cos, sin, cos, ...
        self.register_buffer("table", table.float(), persistent=False)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """x (batch, len, d_model) at positions offset, offset + 1, ...; offset: one int, or (batch,)."""
        return x + rows_at(self.table, offset, x.size(1)).to(x.dtype)


class NoPositions(nn.Module):
    """With rotary positions, order enters inside self-attention; nothing is added here."""

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        return x


class LearnedPositions(nn.Module):
    """One trained vector per position, added to the embeddings."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        self.embed = nn.Embedding(max_positions, d_model)
        nn.init.normal_(self.embed.weight, std=d_model**-0.5)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        return x + rows_at(self.embed.weight, offset, x.size(1))


# --- Feed-forward network and Add & Norm ----------------------------------------------------------


ACTIVATION_FUNCTIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}  # silu(x) = x * sigmoid(x), "swish"


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied at every position separately (GELU or
    SiLU in place of max(0, .) with activation="gelu" or "silu")."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float, activation: str = "relu"):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(activation_dropout)
        self.activation = activation
        for linear in (self.linear1, self.linear2):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.linear1(x)  # (batch, len, d_ff)
        hidden = ACTIVATION_FUNCTIONS[self.activation](hidden)
        return self.linear2(self.dropout(hidden))


class SwiGLUFeedForward(nn.Module):
    """FFN(x) = (SiLU(x W_gate) * x W_up) W_down (Shazeer 2020), without biases.

    Three matrices instead of two, so the hidden size is 2/3 of d_ff (rounded to a multiple
    of 8) to keep the parameter count of the ReLU network.
    """

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float):
        super().__init__()
        hidden = max(8, round(2 * d_ff / 3 / 8) * 8)
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)  # W_gate and W_up in one matrix
        self.down = nn.Linear(hidden, d_model, bias=False)
        self.dropout = nn.Dropout(activation_dropout)
        for linear in (self.gate_up, self.down):
            nn.init.xavier_uniform_(linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.dropout(F.silu(gate) * up))


def make_norm(kind: str, d_model: int) -> nn.Module:
    """LayerNorm (mean and variance) or RMSNorm (root mean square only, no bias; Zhang & Sennrich 2019)."""
    return nn.RMSNorm(d_model) if kind == "rmsnorm" else nn.LayerNorm(d_model)


class AddNorm(nn.Module):
    """Residual connection and normalization (LayerNorm or RMSNorm) around a sublayer.

    Post-norm (the paper): x = LayerNorm(x + Dropout(sublayer(x))).
    Pre-norm:              x = x + Dropout(sublayer(LayerNorm(x))).
    A layer calls `before(x)` to get the sublayer's input and `after(x, y)` with its output y.
    """

    def __init__(self, d_model: int, dropout: float, norm_first: bool, norm: str = "layernorm"):
        super().__init__()
        self.norm, self.dropout, self.norm_first = make_norm(norm, d_model), nn.Dropout(dropout), norm_first

    def before(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.norm_first else x

    def after(self, x: Tensor, y: Tensor) -> Tensor:
        x = x + self.dropout(y)
        return x if self.norm_first else self.norm(x)
