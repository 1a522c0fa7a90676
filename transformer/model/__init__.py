"""The model of "Attention Is All You Need", in five files read in this order:

    transformer.py        the configuration, the masks, the encoder and decoder layers and stacks
    attention.py          scaled dot-product and multi-head attention, rotary positions
    cache.py              what incremental decoding keeps: KeyValueCache, LayerCache, DecoderState
    blocks.py             embeddings, positions, feed-forward networks, Add & Norm
    attention_variants.py the attention variants, each overriding one step of attention

This is the reference: plain PyTorch modules, the same on every device. It imports nothing from
the speed paths (transformer/fast/), training or decoding.
"""

from .cache import DecoderState, KeyValueCache, LayerCache
from .transformer import (
    DecoderLayer,
    EncoderLayer,
    ModelConfig,
    Transformer,
    causal_mask,
    count_parameters,
    padding_mask,
)

__all__ = [
    "DecoderLayer",
    "DecoderState",
    "EncoderLayer",
    "KeyValueCache",
    "LayerCache",
    "ModelConfig",
    "Transformer",
    "causal_mask",
    "count_parameters",
    "padding_mask",
]
