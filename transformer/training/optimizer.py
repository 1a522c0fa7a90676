"""The optimizer training builds: torch's Adam (or AdamW), fused where torch has a fused kernel."""

from __future__ import annotations

import torch


def adam(
    parameters,
    lr: float,
    betas,
    eps: float,
    weight_decay: float,
    device: torch.device,
    fused: bool = True,
    decoupled: bool = False,
) -> torch.optim.Adam:
    """Adam for training. On CPU and CUDA torch's fused implementation updates each weight in one
    pass; the default (foreach) one makes several passes over all the weights and their two
    moments (docs/PERFORMANCE.md). fused=False, or another device, gives the foreach implementation.

    weight_decay is an L2 term added to the gradient (and so rescaled by Adam like the rest of it)
    unless decoupled=True, which shrinks every weight by lr * weight_decay each step on its own:
    AdamW (Loshchilov and Hutter, 2019)."""
    fused = fused and device.type in ("cpu", "cuda")
    return torch.optim.Adam(
        parameters,
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled,
        fused=fused or None,
    )


def trainer_adam(parameters, tcfg, device: torch.device) -> torch.optim.Adam:
    """The optimizer a TrainerConfig asks for."""
    return adam(
        parameters, tcfg.lr, tcfg.betas, tcfg.eps, tcfg.weight_decay, device, decoupled=tcfg.decoupled_weight_decay
    )
