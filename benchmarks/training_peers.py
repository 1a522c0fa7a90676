"""The implementations benchmarks/benchmark.py times, each built as (model, loss function) at one
size: ours (with the variants named in its docstring), torch.nn.Transformer and transformers'
MarianMTModel, on a shared 8,000-piece vocabulary, with the presets' sizes."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from common import TorchTransformer, marian_model, our_model

PRESETS = {  # layers (each side), d_model, heads, d_ff
    "small": (3, 256, 4, 1024),
    "base": (6, 512, 8, 2048),
    "small_modern": (3, 256, 4, 1024),
    "tiny": (1, 64, 2, 128),  # for the tests: what is measured and reported, in little time
}
# Presets whose block is not the paper's: measured for ours only (the peers have no such block).
BLOCKS = {"small_modern": {"norm_first": True, "positional": "rope", "norm": "rmsnorm", "activation": "swiglu"}}
VOCAB = 8000


def build_ours(layers, d_model, heads, d_ff, compile: bool = False, recompute: bool = False, block=None, **runtime):
    """Our model and the trainer's loss; the flags as trainer.compile and trainer.recompute,
    `block` more ModelConfig fields (BLOCKS), `runtime` the fields of a RuntimeConfig (default:
    every speed path, each where it is chosen by default)."""
    from transformer.runtime import RuntimeConfig
    from transformer.training.objective import training_objective

    runtime = RuntimeConfig(**runtime)
    model = our_model(VOCAB, layers, d_model, heads, d_ff, dropout=0.1, runtime=runtime, **(block or {}))
    chunked = getattr(model, "chunked_loss", False)  # as the trainer asks the model its runtime built
    model.recompute = recompute
    forward = torch.compile(model, dynamic=True) if compile else model

    def loss(src, tgt_in, tgt_out):
        out = forward(src, tgt_in, project=not chunked)
        device = src.device.type  # called under autocast when measuring bf16, as the trainer's forward is
        amp_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        with torch.autocast(device, enabled=False):  # the trainer computes its loss outside autocast
            chunked_loss = model.chunked_cross_entropy if chunked else None
            return training_objective(out, tgt_out, 0, 0.1, 0.0, amp_dtype, chunked_loss)[0]

    return model, loss


def peer_loss(logits, tgt_out):
    """The peers' objective: cross-entropy with label smoothing 0.1, summed over non-padding tokens."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), tgt_out.flatten(), ignore_index=0, label_smoothing=0.1, reduction="sum"
    )


def build_torch(layers, d_model, heads, d_ff):
    model = TorchTransformer(VOCAB, layers, d_model, heads, d_ff, dropout=0.1)
    return model, lambda src, tgt_in, tgt_out: peer_loss(model(src, tgt_in), tgt_out)


def build_hf(layers, d_model, heads, d_ff):
    model = marian_model(VOCAB, layers, d_model, heads, d_ff, dropout=0.1)

    def loss(src, tgt_in, tgt_out):
        masks = {"attention_mask": src != 0, "decoder_attention_mask": tgt_in != 0}
        return peer_loss(model(input_ids=src, decoder_input_ids=tgt_in, **masks).logits, tgt_out)

    return model, loss


BUILDERS = {
    "ours": build_ours,
    "ours-compile": partial(build_ours, compile=True),
    "ours-recompute": partial(build_ours, recompute=True),
    "ours-blas": partial(build_ours, onednn_linear=False),
    "ours-onednn": partial(build_ours, onednn_linear=True),
    "ours-logits": partial(build_ours, chunked_loss=False),
    "ours-reference": partial(build_ours, fast=False),
    "ours-foreach": build_ours,  # the optimizer differs: measure_one
    "ours-spin-default": build_ours,  # the environment differs: child_environment
    "torch": build_torch,
    "hf-marian": build_hf,
}
