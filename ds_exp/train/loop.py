"""The training loop: optimizer steps and what train.* asks after each. The data order is a function of (seed, epoch)
and the position in the epoch over all ranks, so a resumed run draws exactly an uninterrupted run's batches."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed import DeepSpeedEngine
from torch.utils.data import DataLoader

from ds_exp.artifacts.loss_plot import LossPlot
from ds_exp.checkpoint.checkpointer import Checkpointer
from ds_exp.config.ds_config import log_interval
from ds_exp.config.plan import eval_interval
from ds_exp.config.schema import EvalConfig, TrainConfig, plain
from ds_exp.core.errors import Diverged
from ds_exp.model.divergence import check_weights_finite, diverged_message, non_finite_end
from ds_exp.runtime.memory import peak_memory_bytes
from ds_exp.runtime.process_group import all_reduce_sum
from ds_exp.runtime.signals import StopRequested
from ds_exp.train.evaluate import Generations, evaluate
from ds_exp.train.hooks import Run
from ds_exp.train.metrics import Metrics
from ds_exp.train.sampler import ResumableDistributedSampler
from ds_exp.train.session import Session
from ds_exp.train.step import Batch, TrainStep
from ds_exp.train.workload import Workload

log = logging.getLogger("ds_exp.train")


@dataclass
class Progress:
    step: int  # optimizer steps done
    epoch: int
    step_in_epoch: int
    last_eval_step: int = -1
    last_save_step: int = -1


class Loop:
    def __init__(
        self,
        train_cfg: TrainConfig,
        eval_cfg: EvalConfig,
        session: Session,
        work: Workload,
        metrics: Metrics,
        checkpoints: Checkpointer,
        generations: Generations,
        progress: Progress,
        run: Run,  # as the features' hooks see it (ds_exp/train/hooks.py): after each step, at each checkpoint
    ) -> None:
        self.train_cfg, self.eval_cfg = train_cfg, eval_cfg
        self.session, self.work, self.metrics = session, work, metrics
        self.checkpoints, self.generations, self.progress = checkpoints, generations, progress
        self.for_hooks, self.hooks = run, run.hooks
        self.loss_plot = LossPlot(session.run_dir, enabled=session.is_main)  # plots/loss.png at each evaluation
        self.engine = work.engine
        built = work.built
        self.step = TrainStep(
            work.engine,
            world_size=session.world,
            flops=work.flops,
            ranks=work.ranks,
            shard=built.shard,
            loss=built.loss,
            inputs=built.inputs,
            objective=work.objective,
        )
        self.schedule = str(plain(work.schedule_name))
        self.eval_every = eval_interval(train_cfg, work.steps_per_epoch, work.total_steps)  # 0: after each epoch
        self.log_every = log_interval(train_cfg, work.total_steps)
        self.bad_steps = 0
        self.last_loss: torch.Tensor | float | None = None
        self.last_labels = 0.0  # the last step's label tokens over the global batch
        self.last_applied = True  # whether the last step's update was applied (ZeRO skips non-finite gradients)
        self.finite_at = -1  # the step whose end state was last found finite (check_end)

    def run(self) -> None:
        """From progress.step to the last step; then nothing is pending (the last metric line is written)."""
        train_cfg, work, progress = self.train_cfg, self.work, self.progress
        micro, accum, ranks = train_cfg.micro_batch_size, train_cfg.gradient_accumulation_steps, work.ranks
        # sharded by data-parallel rank: the ranks of a sequence-parallel group draw the same rows (and split them)
        sampler = ResumableDistributedSampler(
            len(work.data.train), rank=ranks.dp_rank, world_size=ranks.dp_size, seed=train_cfg.seed, drop_last=True
        )
        while progress.step < work.total_steps:
            sampler.set_epoch(progress.epoch)
            sampler.set_start(progress.step_in_epoch * micro * accum * ranks.dp_size)  # counted over all ranks
            loader = iter(
                DataLoader(work.data.train, batch_size=micro, sampler=sampler, collate_fn=work.collator, drop_last=True)
            )
            while progress.step_in_epoch < work.steps_per_epoch and progress.step < work.total_steps:
                started = time.perf_counter()  # fetching the batches is part of the step's time
                self.optimizer_step([next(loader) for _ in range(accum)], started)
            if progress.step_in_epoch >= work.steps_per_epoch:
                progress.epoch += 1
                progress.step_in_epoch = 0
                if not self.eval_every and progress.step < work.total_steps:
                    self.evaluate()  # after each epoch
        self.metrics.write()

    def optimizer_step(self, batches: list[Batch], started: float) -> None:
        """One step, then what follows it: the non-finite check, metric line, evaluation, checkpoint, stop."""
        train_cfg, progress, session = self.train_cfg, self.progress, self.session
        result = self.step(batches, stop_requested=session.signals.requested, previous_loss=self.last_loss)
        if self.last_labels:  # the previous step's loss, summed over ranks by this step's all-reduce: for the bar
            self.metrics.show_step_loss(progress.step, result.votes.previous_loss_sum / self.last_labels)
        self.last_labels = result.votes.global_label_tokens
        self.metrics.write()  # the previous step's line: its all-reduce finished during this step
        self.last_loss, self.last_applied = result.loss_sum, result.applied
        progress.step += 1
        progress.step_in_epoch += 1
        session.state.steps = progress.step
        self.metrics.add(result, time.perf_counter() - started)
        # the votes were cast when this step began: they speak of the step before it
        self.bad_steps = self.bad_steps + 1 if result.votes.non_finite else 0
        if self.bad_steps:
            self.report_non_finite(progress.step - 1)
        if self.work.metric_scheduler is not None and self.schedule == "greedy":
            # the step's loss over all ranks: an extra collective, made only for the schedules that need it
            loss_sum, labels = all_reduce_sum([float(result.loss_sum), float(result.label_tokens)], self.engine.device)
            self.work.metric_scheduler.step(loss_sum / max(labels, 1.0))
        if progress.step % self.log_every == 0 or progress.step == self.work.total_steps:
            self.metrics.close(self.line_fields())
        if self.eval_every and progress.step % self.eval_every == 0:
            self.evaluate()
        if train_cfg.save_every and progress.step % train_cfg.save_every == 0:
            self.save()
        self.hooks.after_step(self.for_hooks, progress.step)  # a step export (ds_exp/exports/), ...
        if result.votes.stop:
            if progress.last_save_step != progress.step:
                self.save()
            self.metrics.write()
            signals = session.signals
            reason = signals.reason or "a signal on another rank"
            raise StopRequested(reason, progress.step, session.state.checkpoint, signals.stopped_status)

    def line_fields(self) -> dict[str, Any]:
        """What a metric line says besides its sums over ranks."""
        progress, engine = self.progress, self.engine
        grad_norm, lrs = engine.get_global_grad_norm(), engine.get_lr()
        return {
            "step": progress.step,
            "epoch": progress.epoch + progress.step_in_epoch / max(self.work.steps_per_epoch, 1),
            "lr": float(lrs[0]) if lrs else float(engine.optimizer.param_groups[0]["lr"]),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "peak_memory_bytes": peak_memory_bytes(self.session.accelerator),
            "loss_scale": loss_scale(engine) if self.session.precision == "fp16" else None,
        }

    def report_non_finite(self, step: int) -> None:
        log.warning("step %d: non-finite loss (%d steps in a row)", step, self.bad_steps)
        max_bad = self.train_cfg.max_bad_steps
        if self.bad_steps > max_bad:
            raise Diverged(
                f"{self.bad_steps} optimizer steps in a row ended with a non-finite loss (last: step {step}); lower "
                f"optimizer.lr or use precision=bf16/fp32 (train.max_bad_steps={max_bad})"
            )

    def evaluate(self) -> dict[str, float]:
        """Collective: perplexity over the eval set; generations too when eval.every_eval asks."""
        progress, work = self.progress, self.work
        self.metrics.write()  # keeps metrics.jsonl in step order
        progress.last_eval_step = progress.step
        if len(work.data.eval) == 0:
            return {}  # no eval split (data.eval_fraction=0 and no source has one): nothing to measure
        result = evaluate(
            self.engine,
            work.data.eval,
            work.collator,
            micro_batch=self.train_cfg.eval_micro_batch_size or self.train_cfg.micro_batch_size,
            rank=self.session.rank,
            world=self.session.world,
            ranks=work.ranks,
            shard=work.built.shard,
            loss=work.built.loss,
            objective=work.objective,
        )
        if work.metric_scheduler is not None and self.schedule == "reduce_lr_on_plateau":
            work.metric_scheduler.step(result["eval_loss"])
        record = {"type": "eval", "step": progress.step, "epoch": progress.epoch, **result}
        shown = {name: result[name] for name in work.objective.shown}
        self.metrics.record(record, {"eval/loss": result["eval_loss"], **{f"eval/{k}": v for k, v in shown.items()}})
        said = " ".join(f"{name} {value:.3f}" for name, value in shown.items())
        log.info("eval at step %d: loss %.5f %s", progress.step, result["eval_loss"], said)
        self.loss_plot.draw()
        self.session.state.final_eval = result  # the last so far
        if self.eval_cfg.every_eval and progress.step not in (0, work.total_steps):
            self.generate()
        return result

    def generate(self) -> None:
        self.metrics.write()
        self.generations(self.engine, self.progress.step, self.metrics.wandb)

    def last_good_checkpoint(self) -> str | None:
        return self.session.state.checkpoint or self.session.state.resumed_from

    def check_end(self) -> None:
        """Collective: a run ending with a non-finite loss, evaluation or weights is diverged, before it is kept."""
        overflowed = not self.last_applied and self.session.precision != "fp16"  # fp16: the loss scaler's skip
        found = non_finite_end(
            self.engine, self.last_loss, self.session.state.final_eval, last_step_overflowed=overflowed
        )
        if found:
            consequence = "saved no final checkpoint and exported nothing"
            raise Diverged(diverged_message(found, self.progress.step, consequence, self.last_good_checkpoint()))
        self.finite_at = self.progress.step

    def save(self) -> None:
        """Collective checkpoint with the open metric window's sums (Metrics.carry); weights not finite never saved."""
        step = self.progress.step
        if self.finite_at != step:
            check_weights_finite(self.engine, step, f"did not save checkpoint step{step}", self.last_good_checkpoint())
        path = self.checkpoints.save(self.progress, self.metrics.carry(), self.session.state.initial_eval)
        self.progress.last_save_step = self.progress.step
        self.session.state.checkpoint = str(path)
        self.hooks.at_checkpoint(self.for_hooks, step, path)


def loss_scale(engine: DeepSpeedEngine) -> float | None:
    """The fp16 loss scaler's scale (cur_scale, or ZeRO's loss_scale)."""
    for name in ("cur_scale", "loss_scale"):
        value = getattr(engine.optimizer, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None
