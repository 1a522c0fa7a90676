"""What a run reports while it trains: TensorBoard scalars, texts, attention images and hparams,
a metrics.jsonl file with the same numbers, a progress bar on stderr when it is a terminal, and
the training throughput behind the numbers."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

from .files import atomic_write_text

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from .data.batching import Batch


def progress_bar(total: int, desc: str, unit: str = "sent", initial: int = 0):
    """A tqdm bar on stderr, shown only when stderr is a terminal (quiet in log files and CI)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        dynamic_ncols=True,
    )


def flat_scalars(config: dict, prefix: str = "") -> dict:
    """Nested config -> {"model.d_model": 256, ...} with only the values TensorBoard's hparams take."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_scalars(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif value is None:
            out[name] = "null"
        else:
            out[name] = str(value)
    return out


def record_step(line: str) -> float:
    """The step of a metrics.jsonl line; infinite for a line a killed process left unfinished."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return math.inf


class Monitor:
    """One SummaryWriter per run (written by the process that trains; rank 0 when distributed).

    `start(step)` must come first: a run that starts (or resumes) at `step` keeps only the records
    up to it, so the steps a resumed run trains again are not logged twice."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.writer: SummaryWriter | None = None
        self.bar = None

    def start(self, step: int) -> None:
        """Drop metrics.jsonl records and TensorBoard events after `step`, then open the writer."""
        if not self.enabled:
            return
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.is_file():
            kept = [line for line in metrics.read_text(encoding="utf-8").splitlines() if record_step(line) <= step]
            atomic_write_text(metrics, "".join(line + "\n" for line in kept))
        from torch.utils.tensorboard import SummaryWriter  # here: decoding commands never load it

        self.writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=step + 1 if step else None)

    def record(self, record: dict) -> None:
        """One JSON object per line in metrics.jsonl: the run's numbers, for plots and checks."""
        if not self.enabled:
            return
        with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def train(
        self,
        step: int,
        epoch: int,
        loss: float,
        lr: float,
        grad_norm: float,
        tok_per_s: float,
        padding: float,
        extra: dict | None = None,
    ) -> None:
        """extra: further scalars of the model (e.g. MoH's balance_loss), logged as train/<name>."""
        extra = extra or {}
        self.record(
            {
                "step": step,
                "epoch": epoch,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tok_per_s,
                "padding_ratio": padding,
            }
            | extra
        )
        scalars = {
            "loss": loss,
            "ppl": math.exp(min(loss, 50)),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tok_per_s,
            "padding_ratio": padding,
        } | extra
        if self.writer:
            for name, value in scalars.items():
                self.writer.add_scalar(f"train/{name}", value, step)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_per_s:.0f}", refresh=False)

    def valid(
        self,
        step: int,
        loss: float,
        bleu: float | None,
        chrf: float | None,
        train_minutes: float | None = None,
        directions: dict[str, float] | None = None,
    ) -> None:
        """train_minutes: the training loop's clock at this validation, as trainer.max_minutes counts it;
        directions: a many-to-many run's BLEU of each direction (valid/bleu_de-en), bleu their mean."""
        record = {"step": step, "valid_loss": loss, "valid_ppl": math.exp(min(loss, 50))}
        if bleu is not None:
            record.update(valid_bleu=bleu, valid_chrf=chrf)
            record.update({f"valid_bleu_{name}": value for name, value in (directions or {}).items()})
        self.record(record if train_minutes is None else record | {"train_minutes": round(train_minutes, 3)})
        if self.writer:
            for name, value in record.items():
                if name != "step":
                    self.writer.add_scalar(f"valid/{name[6:]}", value, step)
            self.writer.flush()

    def samples(self, step: int, rows: list[tuple[str, str, str]]) -> None:
        """A few fixed validation sentences: source, reference and the current translation."""
        if self.writer:
            table = "| source | reference | translation |\n|---|---|---|\n"
            table += "".join(f"| {s} | {r} | {h} |\n" for s, r, h in rows)
            self.writer.add_text("valid/translations", table, step)

    def attention(self, step: int, figures: dict) -> None:
        """{tag: matplotlib figure} -> TensorBoard images (the figures are closed)."""
        if self.writer:
            for tag, figure in figures.items():
                self.writer.add_figure(f"attention/{tag}", figure, step, close=True)

    def hparams(self, config: dict, metrics: dict) -> None:
        if self.writer:
            self.writer.add_hparams(flat_scalars(config), {f"hparam/{k}": v for k, v in metrics.items()}, run_name=".")
            self.writer.flush()

    def progress(self, total: int, initial: int):
        """The training progress bar (steps, loss, lr, tokens/s, ETA)."""
        self.bar = progress_bar(total, "train", unit="step", initial=initial)
        return self.bar

    def close(self) -> None:
        if self.writer:
            self.writer.close()


class Throughput:
    """Mean training loss and source+target tokens per second since the last flush.

    The loss stays on the device until `flush`, so logging costs one host sync per interval.
    """

    def __init__(self):
        self.start, self.tokens, self.loss, self.steps = time.monotonic(), 0, 0.0, 0
        self.local_tokens, self.padded = 0, 0  # this process's batches: real tokens and padded slots

    def add(self, batches: list[Batch], loss: Tensor, tokens: int) -> None:
        """tokens: the step's non-padding source + target tokens (over all ranks when distributed)."""
        self.tokens += tokens
        self.local_tokens += sum(b.n_src_tokens + b.n_tgt_tokens for b in batches)
        self.padded += sum(b.src.numel() + b.tgt_out.numel() for b in batches)  # shapes: no device sync
        self.loss = self.loss + loss.detach()
        self.steps += 1

    def state(self) -> dict:
        """What a resumed run needs to log the same mean loss and padding as an uninterrupted one."""
        loss = self.loss.detach().cpu() if isinstance(self.loss, Tensor) else self.loss
        return {"loss": loss, "steps": self.steps, "local_tokens": self.local_tokens, "padded": self.padded}

    def restore(self, state: dict, device) -> None:
        loss = state["loss"]
        self.loss = loss.to(device) if isinstance(loss, Tensor) else loss
        self.steps, self.local_tokens, self.padded = state["steps"], state["local_tokens"], state["padded"]

    def flush(self) -> tuple[float, float, float]:
        """(mean loss, tokens per second, fraction of padding) of the interval; starts a new one."""
        loss, tok_per_s = float(self.loss) / max(self.steps, 1), self.tokens / (time.monotonic() - self.start)
        padding = 1.0 - self.local_tokens / max(self.padded, 1)  # on this rank; ranks draw alike batches
        self.__init__()
        return loss, tok_per_s, padding
