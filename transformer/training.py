"""The training loop: Adam with the paper's warmup schedule, label-smoothed cross-entropy,
periodic validation (loss and greedy BLEU), last/best checkpoints and early stopping."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .data import Batch, TokenizedCorpus, collate, token_batches
from .decoding import DecodeConfig, translate_corpus
from .evaluation import score
from .model import Transformer

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass
class TrainerConfig:
    device: str = "auto"  # "auto" picks cuda when present, else cpu
    precision: str = "auto"  # auto: bf16 on GPUs that support it (else fp16), bf16 on CPUs with AMX, else fp32
    threads: int = 0  # CPU threads for torch; 0 keeps torch's default
    lr: float = 7e-4  # peak learning rate, reached at the end of warmup
    warmup_steps: int = 4000
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float = 0.0  # max gradient norm; 0 disables clipping
    accumulate: int = 1  # batches per optimizer step (gradient accumulation)
    max_steps: int = 100_000
    max_epochs: int = 0  # 0: no limit
    max_minutes: float = 0.0  # wall-clock budget for the training loop; 0: no limit
    patience: int = 0  # stop after this many validations without a better score; 0: never
    eval_every: int = 1000  # optimizer steps between validations
    eval_bleu: bool = True  # greedy-decode the validation split and select the best checkpoint by BLEU
    log_every: int = 100

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"trainer.precision={self.precision!r} is not one of {PRECISIONS}")
        if self.accumulate < 1 or self.eval_every < 1 or self.log_every < 1 or self.warmup_steps < 1:
            raise ValueError("trainer.accumulate, eval_every, log_every and warmup_steps must be >= 1")


# --- Device, precision, schedule, loss ----------------------------------------------------------


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype matrix products run in under autocast; None means plain fp32."""
    if precision == "auto":
        if device.type == "cuda":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            precision = "bf16" if cpu_has_amx() else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def inverse_sqrt_lr(step: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then decay with 1/sqrt(step).

    With peak = d_model^-0.5 * warmup^-0.5 this is the paper's
    lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).
    """
    step = max(step, 1)
    return peak * min(step / warmup, math.sqrt(warmup / step))


def label_smoothed_loss(logits: Tensor, target: Tensor, pad_id: int, smoothing: float) -> tuple[Tensor, Tensor]:
    """Summed over non-padding tokens: (label-smoothed loss, plain negative log-likelihood).

    The smoothed target puts 1 - smoothing on the reference token and spreads `smoothing`
    uniformly over the vocabulary.
    """
    lprobs = F.log_softmax(logits.float(), dim=-1)  # (batch, len, vocab)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    uniform = -lprobs.mean(-1)
    keep = target != pad_id
    loss = ((1.0 - smoothing) * nll + smoothing * uniform).masked_fill(~keep, 0.0).sum()
    return loss, nll.masked_fill(~keep, 0.0).sum()


# --- The trainer --------------------------------------------------------------------------------


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 1
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    best_score: float = -math.inf  # validation BLEU, or minus the validation loss without BLEU
    bad_evals: int = 0
    train_tokens: int = 0  # non-padding source + target tokens seen
    train_seconds: float = 0.0  # wall time of the loop, validation included
    valid_seconds: float = 0.0  # of which validation


class Trainer:
    def __init__(self, cfg, run_dir: Path, model: Transformer, tokenizer, train: TokenizedCorpus, valid: TokenizedCorpus):
        self.cfg, self.tcfg, self.run_dir = cfg, cfg.trainer, Path(run_dir)
        self.device = next(model.parameters()).device
        self.model, self.tokenizer, self.train_data, self.valid_data = model, tokenizer, train, valid
        self.amp_dtype = autocast_dtype(self.tcfg.precision, self.device)
        self.optimizer = torch.optim.Adam(
            model.parameters(), lr=self.tcfg.lr, betas=tuple(self.tcfg.betas), eps=self.tcfg.eps, weight_decay=self.tcfg.weight_decay
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.state = TrainState()
        self.lengths = train.lengths()

    # ---- batches

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The batches of one epoch: a fixed function of (seed, epoch), so runs are reproducible."""
        rng = np.random.default_rng([self.cfg.seed, epoch])
        return token_batches(self.lengths, self.cfg.data.max_tokens, rng)

    def batch_stream(self):
        """Yields batches forever, tracking the epoch and the position inside it."""
        while True:
            batches = self.epoch_batches(self.state.epoch)
            while self.state.batch_in_epoch < len(batches):
                indices = batches[self.state.batch_in_epoch]
                self.state.batch_in_epoch += 1
                yield collate(self.train_data, indices, self.tokenizer).to(self.device)
            self.state.epoch += 1
            self.state.batch_in_epoch = 0

    # ---- one optimizer step

    def train_step(self, batches: list[Batch]) -> Tensor:
        """Forward and backward over `batches` (gradient accumulation), then one update."""
        self.model.train()
        n_tokens = sum(b.n_tgt_tokens for b in batches)
        total = torch.zeros((), device=self.device)
        for batch in batches:
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                logits = self.model(batch.src, batch.tgt_in)
            loss, _ = label_smoothed_loss(logits, batch.tgt_out, self.tokenizer.pad_id, self.tcfg.label_smoothing)
            self.scaler.scale(loss / n_tokens).backward()
            total += loss.detach()
        self.state.step += 1
        for group in self.optimizer.param_groups:
            group["lr"] = inverse_sqrt_lr(self.state.step, self.tcfg.lr, self.tcfg.warmup_steps)
        if self.tcfg.clip_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return total / n_tokens

    # ---- validation

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Per-token negative log-likelihood of the validation split (perplexity = exp of it)."""
        self.model.eval()
        nll_sum, n_tokens = torch.zeros((), device=self.device), 0
        for indices in token_batches(self.valid_data.lengths(), self.cfg.data.max_tokens):
            batch = collate(self.valid_data, indices, self.tokenizer).to(self.device)
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                logits = self.model(batch.src, batch.tgt_in)
            nll_sum += label_smoothed_loss(logits, batch.tgt_out, self.tokenizer.pad_id, 0.0)[1]
            n_tokens += batch.n_tgt_tokens
        return float(nll_sum) / n_tokens

    def validate(self) -> float:
        """Log validation metrics and return the score that selects the best checkpoint."""
        loss = self.validation_loss()
        message = f"validation step {self.state.step}: loss {loss:.3f} ppl {math.exp(min(loss, 50)):.2f}"
        score_value = -loss
        if self.tcfg.eval_bleu:
            hyps = translate_corpus(self.model, self.valid_data, self.tokenizer, self.cfg.decode, self.device)
            scores = score(hyps, self.valid_data.tgt_text)
            message += f" BLEU {scores.bleu:.2f} chrF {scores.chrf:.2f}"
            score_value = scores.bleu
        log.info(message)
        return score_value

    # ---- checkpoints

    def save(self, name: str) -> Path:
        from . import checkpoint  # local import: checkpoint -> model only, keeps imports one-way

        path = self.run_dir / name
        checkpoint.save(
            path,
            self.model,
            self.tokenizer,
            train_config=to_plain(self.cfg),
            step=self.state.step,
            optimizer=self.optimizer.state_dict(),
            train_state=vars(self.state).copy(),
        )
        return path

    def after_validation(self, value: float) -> bool:
        """Save checkpoints; return True when early stopping says to stop."""
        self.save("checkpoint_last.pt")
        if value > self.state.best_score:
            self.state.best_score, self.state.bad_evals = value, 0
            self.save("checkpoint_best.pt")
            return False
        self.state.bad_evals += 1
        return 0 < self.tcfg.patience <= self.state.bad_evals

    # ---- the loop

    def stop_reason(self, started: float) -> str | None:
        t = self.tcfg
        if self.state.step >= t.max_steps:
            return f"reached trainer.max_steps={t.max_steps}"
        if t.max_epochs and self.state.epoch > t.max_epochs:
            return f"reached trainer.max_epochs={t.max_epochs}"
        if t.max_minutes and time.monotonic() - started >= 60 * t.max_minutes:
            return f"reached trainer.max_minutes={t.max_minutes}"
        return None

    def fit(self) -> None:
        started = time.monotonic()
        stream, window = self.batch_stream(), Throughput()
        reason = None
        while reason is None:
            batches = [next(stream) for _ in range(self.tcfg.accumulate)]
            loss = self.train_step(batches)
            window.add(batches, loss)
            self.state.train_tokens += sum(b.n_src_tokens + b.n_tgt_tokens for b in batches)
            if self.state.step % self.tcfg.log_every == 0:
                self.log_progress(window)
            reason = self.stop_reason(started)
            if self.state.step % self.tcfg.eval_every == 0 or reason is not None:
                self.state.train_seconds = time.monotonic() - started
                valid_started = time.monotonic()
                value = self.validate()
                self.state.valid_seconds += time.monotonic() - valid_started
                if self.after_validation(value) and reason is None:
                    reason = f"no better validation score in trainer.patience={self.tcfg.patience} validations"
        self.state.train_seconds = time.monotonic() - started
        log.info("training stopped at step %d (epoch %d): %s", self.state.step, self.state.epoch, reason)

    def log_progress(self, window: Throughput) -> None:
        loss, tok_per_s = window.flush()
        lr = self.optimizer.param_groups[0]["lr"]
        log.info(
            "step %d epoch %d: loss %.3f lr %.2e %.0f tok/s",
            self.state.step, self.state.epoch, loss, lr, tok_per_s,
        )  # fmt: skip


class Throughput:
    """Mean training loss and source+target tokens per second since the last flush.

    The loss stays on the device until `flush`, so logging costs one host sync per interval.
    """

    def __init__(self):
        self.start, self.tokens, self.loss, self.steps = time.monotonic(), 0, 0.0, 0

    def add(self, batches: list[Batch], loss: Tensor) -> None:
        self.tokens += sum(b.n_src_tokens + b.n_tgt_tokens for b in batches)
        self.loss = self.loss + loss.detach()
        self.steps += 1

    def flush(self) -> tuple[float, float]:
        """(mean loss, tokens per second) of the interval; starts a new interval."""
        loss, tok_per_s = float(self.loss) / max(self.steps, 1), self.tokens / (time.monotonic() - self.start)
        self.__init__()
        return loss, tok_per_s


def to_plain(cfg) -> dict:
    """A dataclass config as nested plain dicts/lists (safe for weights_only loading)."""
    return asdict(cfg)
