"""Data-parallel training with torchrun: two CPU processes (gloo) make the same updates as one
process accumulating their two batches, and end with identical weights."""

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing

from transformer import checkpoint
from transformer.data.batching import Batch
from transformer.monitoring import Throughput
from transformer.training import distributed

from .test_cli import run

COMMON = [
    "experiment=smoke",
    "data.vocab_size=300",
    "data.max_tokens=256",  # many small batches, so 8 steps stay inside the first epoch
    "data.test_splits=[]",
    "model.dropout=0.0",
    "trainer.max_steps=6",
    "trainer.eval_every=6",
    "trainer.log_every=1",
    "trainer.threads=1",
    "trainer.precision=fp32",
    "trainer.attention_images=false",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.e2e
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_two_processes_equal_one_process_accumulating_their_batches(shared_corpus, tmp_path):
    """...and a distributed run resumed from its checkpoint continues exactly."""
    single_dir, ddp_dir, data = tmp_path / "single", tmp_path / "ddp", f"data.dir={shared_corpus}"
    single = run("train.py", *COMMON, data, "trainer.max_steps=8", "trainer.accumulate=2", f"hydra.run.dir={single_dir}")  # fmt: skip
    assert single.returncode == 0, single.stderr[-2000:]

    def launch(*overrides):
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "--master_addr=127.0.0.1"]  # fmt: skip
        return run(*launcher, "train.py", *COMMON, data, f"hydra.run.dir={ddp_dir}", *overrides)

    ddp = launch()  # 6 steps; validation and checkpoint at step 6
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "all 2 processes hold identical weights" in ddp.stdout + ddp.stderr
    assert "2 processes" in (ddp_dir / "train.log").read_text()
    assert len(losses(ddp_dir)) == 6  # rank 0 alone writes the log of numbers
    resumed = launch("trainer.max_steps=8")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 6" in (ddp_dir / "train.log").read_text()

    torch.testing.assert_close(torch.tensor(losses(ddp_dir)), torch.tensor(losses(single_dir)), rtol=1e-4, atol=1e-5)
    a = checkpoint.load(single_dir / "checkpoint_last.pt")["model"]
    b = checkpoint.load(ddp_dir / "checkpoint_last.pt")["model"]
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)


def native_threads() -> list[str]:
    """The names of this process's threads (gloo's: gloo_tcp_loop, pt_gloo_runloop)."""
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


def leave_after_data_parallel(rank: int, port: int) -> None:
    """One rank of a fresh 2-process world: wrap a model for data parallelism, drop it, leave."""
    from .conftest import make_model

    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    os.environ.update(env)
    world = distributed.start(torch.device("cpu"))
    distributed.data_parallel(make_model(), torch.device("cpu"))  # imports torch._dynamo, as training does
    distributed.stop(world)
    left = [name for name in native_threads() if "gloo" in name]
    assert not left, f"rank {rank} left the process group, but its gloo threads still run: {left}"


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through /proc")
def test_leaving_the_process_group_ends_its_threads():
    """stop() destroys the gloo group then and there, joining its threads; a group still held
    when the interpreter ends is torn down during its finalization, where a rank can abort
    (docs/lab/2026-12-07-distributed-abort-cause.md)."""
    torch.multiprocessing.spawn(leave_after_data_parallel, args=(free_port(),), nprocs=2)


def test_padding_fraction_counts_this_rank_only_while_tokens_count_every_rank():
    """Distributed, the logged tokens are every rank's but the padded slots are this rank's, so the
    padding fraction must come from this rank's own tokens."""
    src, tgt = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    batch = Batch(src, tgt, tgt, np.arange(2), n_src_tokens=8, n_tgt_tokens=7)  # 15 of 20 slots are tokens
    window = Throughput()
    window.add([batch], torch.tensor(1.0), tokens=30)  # two ranks' tokens
    _, _, padding = window.flush()
    assert padding == pytest.approx(0.25)
