"""The training loop: one optimizer step (forward, backward, update), periodic validation
(loss and greedy BLEU, attention images), early stopping and the log lines. What the budget
decides (learning rate, dropout) is plan.py, the checkpoint files and resuming checkpoints.py,
the objective objective.py, the optimizer optimizer.py."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from pathlib import Path

import torch
from torch import Tensor

from ..data.batching import Batch, TokenizedCorpus
from ..devices import autocast_dtype
from ..errors import TrainingStopped
from ..model import Transformer
from ..monitoring import Monitor, Throughput
from ..plotting import attention_figures
from .batches import EpochBatches, TrainState
from .checkpoints import CheckpointKeeper
from .distributed import World, data_parallel
from .objective import training_objective
from .optimizer import trainer_adam
from .plan import BudgetPlan
from .resume import GracefulStop
from .validation import validate

log = logging.getLogger(__name__)


# --- The trainer --------------------------------------------------------------------------------


class Trainer:
    def __init__(
        self,
        cfg,
        run_dir: Path,
        model: Transformer,
        tokenizer,
        train: TokenizedCorpus,
        valid: TokenizedCorpus,
        world: World | None = None,
    ):
        """With a distributed `world` (torchrun), the model is wrapped for data parallelism and
        only rank 0 validates, logs and saves; see distributed.py."""
        world = world or World()
        self.cfg, self.tcfg, self.run_dir, self.world = cfg, cfg.trainer, Path(run_dir), world
        self.device = next(model.parameters()).device
        self.model, self.tokenizer, self.train_data, self.valid_data = model, tokenizer, train, valid
        self.forward_model = model  # what training calls: the model, or its DistributedDataParallel wrapper
        model.recompute = self.tcfg.recompute
        if world.distributed:
            self.forward_model = data_parallel(model, self.device)
        if self.tcfg.compile:
            self.forward_model = torch.compile(self.forward_model, dynamic=True)
        self.amp_dtype = autocast_dtype(self.tcfg.precision, self.device)
        t = self.tcfg
        self.optimizer = trainer_adam(model.parameters(), t, self.device)
        # The fast runtime's output layer and loss in chunks (runtime.chunked_loss; fast/model.py).
        self.chunked_loss = getattr(model, "chunked_loss", False)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.state = TrainState()
        self.batches = EpochBatches(cfg, train, tokenizer, world, self.device)
        self.plan = BudgetPlan(self.tcfg, cfg.model.dropout, self.batches)
        self.monitor = Monitor(run_dir, enabled=world.is_main)
        self.step_tokens = torch.zeros(())  # source + target tokens of the last step, over all ranks
        self.grad_norm = torch.zeros(())
        self.aux_loss = torch.zeros((), device=self.device)  # summed over steps since the last log line
        self.started = time.monotonic()  # the training clock's zero (set again by fit, for resumed runs)
        self.window = Throughput()  # the steps since the last log line
        self.checkpoints = CheckpointKeeper(cfg, run_dir, model, tokenizer, self.optimizer, self.scaler, self.window)

    # ---- one optimizer step

    def train_step(self, batches: list[Batch]) -> Tensor | None:
        """Forward and backward over `batches` (gradient accumulation), then one update.

        Returns the mean loss per target token, or None when the update was skipped because the
        loss or the gradients were not finite."""
        self.model.train()
        seconds = time.monotonic() - self.started
        counts = torch.tensor(
            [
                sum(b.n_tgt_tokens for b in batches),
                sum(b.n_src_tokens + b.n_tgt_tokens for b in batches),
                seconds / self.world.size,  # ranks average their clocks, so they agree on the learning rate
            ],
            dtype=torch.float64,
            device=self.device,
        )
        n_tokens, self.step_tokens, mean_seconds = self.world.sum(counts).float().unbind()  # over all ranks
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            with self.synchronizing_gradients(last=i == len(batches) - 1):
                total += self.backward(batch, n_tokens, len(batches))
        self.world.sum(total)  # every rank sees the same loss, so all agree on skipping a step
        seconds = float(mean_seconds) if self.world.distributed else seconds
        return total / n_tokens if self.update(total, seconds) else None

    def update(self, total: Tensor, seconds: float) -> bool:
        """Clip the gradients and update the weights with the learning rate (and the dropout) the
        budget plans `seconds` into training; False when the update was skipped (not finite)."""
        self.scaler.unscale_(self.optimizer)
        self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.clip_norm or math.inf)
        # fp16's gradient scaler skips overflowing steps itself; only a non-finite loss is bad there.
        finite = total.isfinite() if self.scaler.is_enabled() else total.isfinite() & self.grad_norm.isfinite()
        if not bool(finite):
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update()
            return False
        self.state.step += 1
        lr = self.plan.learning_rate(self.state, seconds)
        message = self.plan.plan_dropout(self.model, self.state, seconds)
        if message and self.world.is_main:
            log.info(message)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def backward(self, batch: Batch, n_tokens: Tensor, n_batches: int) -> Tensor:
        """Forward and backward of one batch; returns its summed label-smoothed loss.

        The loss is divided by the step's target tokens over all ranks, and multiplied by the
        world size because data parallelism averages gradients over ranks: the update is that
        of one process over all the ranks' batches."""
        pad, smoothing = self.tokenizer.pad_id, self.tcfg.label_smoothing
        if self.tcfg.rdrop:  # the batch twice, with independent dropout: one forward pass of twice the rows
            src, tgt_in = batch.src.repeat(2, 1), batch.tgt_in.repeat(2, 1)
        else:
            src, tgt_in = batch.src, batch.tgt_in
        chunked = self.chunked_loss and not self.tcfg.rdrop  # R-Drop's KL needs the logits
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            out = self.forward_model(src, tgt_in, project=not chunked)
        chunked_loss = self.model.chunked_cross_entropy if chunked else None
        loss, objective = training_objective(
            out, batch.tgt_out, pad, smoothing, self.tcfg.rdrop, self.amp_dtype, chunked_loss
        )
        objective = objective * self.world.size / n_tokens
        aux = self.model.auxiliary_loss()  # MoH load balancing, already weighted
        if aux is not None:
            objective = objective + aux / n_batches
            self.aux_loss = self.aux_loss + aux.detach() / n_batches
        self.scaler.scale(objective).backward()
        return loss.detach()

    def synchronizing_gradients(self, last: bool):
        """Data parallelism exchanges gradients once per update: on the last accumulated batch."""
        if self.world.distributed and not last:
            return self.forward_model.no_sync()
        return contextlib.nullcontext()

    def skip_bad_step(self) -> None:
        """Count a skipped update; give up after trainer.max_bad_steps in a row."""
        self.state.bad_steps += 1
        log.warning(
            "step %d: non-finite loss or gradients, update skipped (%d in a row)",
            self.state.step + 1,
            self.state.bad_steps,
        )
        if self.state.bad_steps >= self.tcfg.max_bad_steps:
            raise TrainingStopped(
                f"stopped: {self.state.bad_steps} consecutive steps with non-finite loss or gradients after step "
                f"{self.state.step} (trainer.max_bad_steps); the last good checkpoint is {self.run_dir / 'checkpoint_last.pt'}. "
                "Try a lower trainer.lr, trainer.clip_norm=1.0 or trainer.precision=fp32.",
                exit_code=3,
            )

    # ---- validation

    def validate(self) -> float:
        """Log validation metrics (and attention images) and return the score that selects the best checkpoint."""
        result = validate(
            self.model, self.valid_data, self.tokenizer, self.cfg.decode, self.cfg.data.max_tokens,
            self.device, self.amp_dtype, self.tcfg.eval_bleu, self.cfg.runtime.precision,
        )  # fmt: skip
        loss, bleu = result.loss, result.bleu
        message = f"validation step {self.state.step}: loss {loss:.3f} ppl {math.exp(min(loss, 50)):.2f}"
        if bleu is not None:
            message += f" BLEU {bleu:.2f} chrF {result.chrf:.2f}"
            if result.directions:
                message += (
                    " (mean of " + ", ".join(f"{name} {value:.2f}" for name, value in result.directions.items()) + ")"
                )
            valid = self.valid_data
            self.monitor.samples(self.state.step, list(zip(valid.src_text[:3], valid.tgt_text[:3], result.hyps[:3])))
            if self.tcfg.attention_images:
                figures = attention_figures(self.model, self.tokenizer, valid.src[0], result.hyp_ids[0])
                self.monitor.attention(self.state.step, figures)
        log.info(message)
        self.monitor.valid(self.state.step, loss, bleu, result.chrf, self.state.train_seconds / 60, result.directions)
        return bleu if bleu is not None else -loss

    # ---- resuming

    def restore(self, payload: dict) -> None:
        """Continue exactly where a resumable checkpoint left off (checkpoints.py), with the
        dropout the budget planned."""
        self.state = self.checkpoints.restore(payload)
        self.plan.apply(self.model, self.state)
        log.info(
            "resumed at step %d (epoch %d, batch %d of the epoch)",
            self.state.step,
            self.state.epoch,
            self.state.batch_in_epoch,
        )

    # ---- the loop

    def stop_reason(self, started: float) -> str | None:
        t = self.tcfg
        if self.state.step >= t.max_steps:
            return f"reached trainer.max_steps={t.max_steps}"
        if t.max_epochs and self.state.epoch > t.max_epochs:
            return f"reached trainer.max_epochs={t.max_epochs}"
        if t.max_tokens_seen and self.state.train_tokens >= t.max_tokens_seen:
            return f"reached trainer.max_tokens_seen={t.max_tokens_seen}"
        if t.max_minutes and time.monotonic() - started >= 60 * t.max_minutes:
            return f"reached trainer.max_minutes={t.max_minutes}"
        return None

    def fit(self) -> None:
        self.started = started = time.monotonic() - self.state.train_seconds  # a resumed run keeps its clock
        stream, window = self.batches.stream(self.state), self.window
        reason, interrupted, validated = self.stop_reason(started), False, True
        with GracefulStop() as stop, self.monitor.progress(self.tcfg.max_steps, self.state.step) as bar:
            while reason is None and not interrupted:
                batches = [next(stream) for _ in range(self.tcfg.accumulate)]
                loss = self.train_step(batches)
                if loss is None:
                    self.skip_bad_step()
                    continue
                self.state.bad_steps = 0
                bar.update(1)
                tokens = sum(b.n_src_tokens + b.n_tgt_tokens for b in batches)
                if self.world.distributed:
                    tokens = int(self.step_tokens)  # every rank's
                window.add(batches, loss, tokens)
                self.state.train_tokens += tokens
                if self.state.step % self.tcfg.log_every == 0:
                    self.log_progress(window)
                reason, interrupted = self.world.agree(self.stop_reason(started), stop.requested, self.device)
                validated = self.validates_now(stopping=reason is not None)
                if validated:
                    reason = self.validate_and_save(started) or reason
            self.state.train_seconds = time.monotonic() - started
            # A signal, or a stop too soon after a validation to number a near-copy of its checkpoint
            if self.world.is_main and (interrupted or (reason and not validated)):
                self.checkpoints.save("checkpoint_last.pt", self.state)
            if interrupted:
                self.world.barrier()
                signum = stop.signum or signal.SIGTERM  # a rank without the signal stops with the others
                raise TrainingStopped(
                    f"interrupted by signal {int(signum)} at step {self.state.step}; saved {self.run_dir / 'checkpoint_last.pt'}",
                    exit_code=128 + int(signum),
                    resume_dir=self.run_dir,
                )
        log.info("training stopped at step %d (epoch %d): %s", self.state.step, self.state.epoch, reason)
        if self.world.distributed:
            self.world.check_identical(self.model)

    def validates_now(self, stopping: bool) -> bool:
        """Every trainer.eval_every steps, and at a stop between them unless it comes within a
        quarter of that after a validation: the averaged checkpoints stay that far apart."""
        step, every = self.state.step, self.tcfg.eval_every
        return step % every == 0 or (stopping and (step < every or step % every >= every / 4))

    def validate_and_save(self, started: float) -> str | None:
        """Validate, save checkpoints; returns a stop reason when early stopping says so.
        Distributed, rank 0 does this alone and tells the others its decision."""
        self.state.train_seconds = time.monotonic() - started
        reason = None
        if self.world.is_main:
            valid_started = time.monotonic()
            value = self.validate()
            self.state.valid_seconds += time.monotonic() - valid_started
            self.state.train_seconds = time.monotonic() - started  # the saved clock counts this validation
            improved = self.checkpoints.after_validation(self.state, value)
            if not improved and 0 < self.tcfg.patience <= self.state.bad_evals:
                reason = f"no better validation score in trainer.patience={self.tcfg.patience} validations"
        return self.world.broadcast(reason)

    def log_progress(self, window: Throughput) -> None:
        steps = window.steps
        loss, tok_per_s, padding = window.flush()
        lr = self.optimizer.param_groups[0]["lr"]
        extra = {}
        if self.cfg.model.attention.kind == "moh":
            extra["balance_loss"] = float(self.aux_loss) / max(steps, 1)
            self.aux_loss = torch.zeros((), device=self.device)
        self.monitor.train(
            self.state.step, self.state.epoch, loss, lr, float(self.grad_norm), tok_per_s, padding, extra
        )
        log.info(
            "step %d epoch %d: loss %.3f lr %.2e %.0f tok/s",
            self.state.step, self.state.epoch, loss, lr, tok_per_s,
        )  # fmt: skip
