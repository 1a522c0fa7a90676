"""Data-parallel training across processes, started by torchrun.

    torchrun --nproc_per_node=4 train.py ...                       # one machine, 4 processes
    torchrun --nnodes=2 --node_rank=R --rdzv_backend=c10d \\
             --rdzv_endpoint=HOST:29500 --nproc_per_node=8 train.py ...   # two machines

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them (plain `python train.py`) training
runs in one process and nothing here does anything. The backend is NCCL with one GPU per process,
gloo on CPU. Every rank builds the same epoch of batches from the seed and takes every
world_size-th one; gradients are summed across ranks and divided by the global number of target
tokens, so a step equals one single-process step over the union of the ranks' batches (the same
as trainer.accumulate=world_size). Rank 0 alone logs, validates, writes checkpoints and
evaluates; the others wait for it.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import TrainingStopped

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def device(self, device: torch.device) -> torch.device:
        """One GPU per process on a machine; CPU stays CPU."""
        if device.type == "cuda" and self.distributed:
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return device

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over ranks, in place; returns it."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def agree(self, reason: str | None, interrupted: bool, device: torch.device) -> tuple[str | None, bool]:
        """Ranks stop together: when one reaches its budget or gets a signal, all do."""
        if not self.distributed:
            return reason, interrupted
        flags = torch.tensor([float(reason is not None), float(interrupted)], device=device)
        self.sum(flags)
        if flags[0] > 0 and reason is None:
            reason = "another rank reached its budget"
        return reason, bool(flags[1] > 0)

    def check_identical(self, model: torch.nn.Module) -> None:
        """Data parallelism must leave every rank with the same weights; compare fingerprints."""
        with torch.no_grad():
            fingerprint = torch.stack([p.double().sum() for p in model.parameters()])
            gathered = [torch.empty_like(fingerprint) for _ in range(self.size)]
            dist.all_gather(gathered, fingerprint)
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            raise TrainingStopped(f"the weights of the {self.size} processes diverged", exit_code=3)
        log.info("all %d processes hold identical weights", self.size)

    def broadcast(self, value):
        """Rank 0's value of a picklable object, on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` wrapped so that backward passes sum its gradients over the ranks."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=model.cfg.attention.kind != "standard",  # e.g. MoH heads nobody chose
    )


def launched() -> bool:
    """Whether torchrun started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def start(device: torch.device) -> World:
    """Join the process group torchrun set up (if any)."""
    if not launched():
        return World()
    world = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(world.local_rank)
        # Before the group exists: torch.distributed.nn.functional binds `group=group.WORLD` as
        # its functions' default when first imported (DistributedDataParallel imports it through
        # torch._dynamo). Imported later, it would hold our group past destroy_process_group, and
        # the gloo threads would be torn down at interpreter exit instead of in stop().
        importlib.import_module("torch.distributed.nn.functional")

        # Validation and test decoding run on rank 0 while the others wait: allow them time.
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))
    return world


def stop(world: World) -> None:
    """Leave the process group. Objects still holding it (the DDP wrapper of a finished run) go
    first, so that destroying it joins its gloo threads here and not at interpreter exit
    (docs/lab/2026-12-07-distributed-abort-cause.md)."""
    if world.distributed and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
