"""The supervised fine-tuning recipe (DeepSpeed-Chat step 1's main.py, readable and exact).

setup (launch, distributed, run directory, logs) -> data -> DeepSpeed config -> model -> engine -> resume
-> loop (train, log, evaluate, checkpoint) -> export -> summary.

The loss of an optimizer step is the sum of token losses over the whole global batch divided by its number
of label tokens: it does not depend on how the batch is split over ranks and micro batches, and padding
never counts. Perplexity is exp(summed eval token loss / eval label tokens) over the whole eval set.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ds_exp import checkpoint
from ds_exp.accelerator import detect_accelerator, resolved_precision
from ds_exp.config.ds_config import RunFacts, replaced_by_config_file, resolve_ds_config
from ds_exp.config.schema import plain
from ds_exp.distributed import detect_launch, init_distributed, is_lost_peer, mark_lost_peer
from ds_exp.errors import DsExpError, ResumeError, RunFailed
from ds_exp.flops import device_name, flops_model, numel, peak_flops, sum_squared_lengths
from ds_exp.plan import steps_per_epoch, total_steps, warmup_steps
from ds_exp.resume import check_resume, settings_of
from ds_exp.run_dir import set_aside_attempt
from ds_exp.run_logging import FILE_LOGGER, STEP_LOGGER, close_run_logging, setup_run_logging
from ds_exp.secrets import redact, redact_text, register_secrets
from ds_exp.signals import StopRequested, StopSignals
from ds_exp.tracking import MetricsLog, WandbRun, write_json_atomic

log = logging.getLogger("ds_exp.train")
step_log = logging.getLogger(STEP_LOGGER)
file_log = logging.getLogger(FILE_LOGGER)

IGNORE_INDEX = -100
# how a run ends with every rank alive and its state saved: finished, or stopped by a signal and resumable
RESUMABLE_ENDS = ("completed", "stopped", "requeued")


class NothingToDo(Exception):
    """A resume of a run that is complete already: nothing is trained, saved, exported or rewritten."""


def token_loss_sum(logits: Any, labels: Any) -> tuple[Any, Any]:
    """Summed next-token cross-entropy over label tokens (fp32), and how many there were."""
    import torch.nn.functional as F

    # Shift the labels, not the logits: slicing the logits would copy them (batch x length x vocabulary) and
    # scatter their gradient back; the padded last position is ignored like any other masked token.
    shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss, (shift_labels != IGNORE_INDEX).sum()


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """input_ids with attention_mask, or with position_ids for packed batches (each example attends to itself)."""
    return {k: v for k, v in batch.items() if k != "labels"}


def input_tokens(batch: dict[str, Any]) -> float:
    """Counted on the host batch (before it moves to the device), so counting never syncs with the device."""
    mask = batch.get("attention_mask")
    return float(mask.sum()) if mask is not None else float(batch["input_ids"].numel())


def label_tokens(batch: dict[str, Any]) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def peak_memory_bytes(accelerator: str) -> int:
    if accelerator == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # peak RSS (Linux reports KiB)


def all_reduce_sum(values: list[float], device: Any) -> list[float]:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


@dataclass
class Window:
    """This rank's sums since the last metric line; reduced over ranks when the line is written, so a step
    costs no collective of its own for them."""

    loss_sum: Any = 0.0  # a tensor once a step has run: read (a device sync on GPUs) only when the line is written
    label_tokens: float = 0.0
    input_tokens: float = 0.0
    samples: float = 0.0
    flops: float = 0.0  # model FLOPs of this rank's batches (ds_exp.flops), counted on the host
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)


@dataclass
class StepVotes:
    """What every rank learns at the start of a step from the one all-reduce the step makes anyway."""

    global_label_tokens: float  # this step's, over all ranks and micro batches
    stop: float  # ranks that had caught a stop signal when the step began
    non_finite: float  # ranks whose previous step ended with a non-finite loss


@dataclass
class PendingLine:
    """A metric line whose sums over ranks are still being all-reduced: written once they arrive, at the next
    step (or before anything else is logged or saved), so that no rank waits for the slower one to write it."""

    work: Any  # the async all-reduce
    sums: Any  # its tensor: loss sum, label tokens, input tokens, samples, model FLOPs
    record: dict[str, Any]  # the line, less what the sums give
    elapsed: float
    bar: Any


@dataclass
class Progress:
    step: int
    epoch: int
    step_in_epoch: int
    last_eval_step: int = -1
    last_save_step: int = -1


class Trainer:
    """One run: holds the engine and the data, and runs the loop. Built by `train()`."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        # known from the environment alone, so a failure during setup is still reported by the right rank
        self.launch = detect_launch(cfg.dist)
        self.rank, self.world = self.launch.rank, self.launch.world_size
        self.is_main = self.rank == 0
        self.accelerator = detect_accelerator()
        self.backend = self.precision = None
        self.stop = StopSignals(self.launch.launcher)
        self.progress: Progress | None = None  # set once the loop starts
        self.pending_line: PendingLine | None = None  # a metric line waiting for its sums over ranks

    # ----------------------------------------------------------------- setup
    def setup(self) -> None:
        import torch
        import torch.distributed as dist
        from deepspeed.accelerator import get_accelerator

        cfg = self.cfg
        if self.accelerator != "cpu":
            self.accelerator = get_accelerator().device_name()
        self.backend = init_distributed(cfg.dist, self.launch, self.accelerator)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        shared = [str(self.run_dir)]
        dist.broadcast_object_list(shared, src=0)  # every rank works in rank 0's run directory
        self.run_dir = Path(shared[0])
        # values of credential keys, however they got into the config (a YAML file, ${oc.env:...}), and of
        # credential-named environment variables: blanked in every log line from here on
        register_secrets(OmegaConf.to_container(cfg, resolve=True), environ=dict(os.environ))
        self.log_file = setup_run_logging(self.run_dir, self.rank)
        self.precision = resolved_precision(cfg.precision.dtype, self.accelerator)
        log.info(
            "launch %s: rank %d of %d on host %s, %s backend on %s, %s, %d CPU threads",
            self.launch.launcher,
            self.rank,
            self.world,
            os.uname().nodename,
            self.backend,
            self.accelerator,
            self.precision,
            torch.get_num_threads(),
        )

    def prepare(self) -> None:
        from ds_exp.config.model_checks import max_seq_len_notes
        from ds_exp.data import load_tokenizer, make_collator, prepare_sft_data
        from ds_exp.engine import build_engine, check_deepspeed_config
        from ds_exp.generate import load_prompts, stop_token_ids
        from ds_exp.model import build_model, build_model_config, hidden_size_of

        cfg = self.cfg
        if self.is_main:
            for note in max_seq_len_notes(cfg):
                log.warning(note)
        self.tokenizer = load_tokenizer(cfg)
        # the model's config before the data: a checkpoint transformers cannot read fails before tokenizing
        model_config = build_model_config(cfg, self.tokenizer)
        self.data = prepare_sft_data(cfg, self.tokenizer)
        file_log.info("data statistics: %s", self.data.stats)  # the console has the pipeline's sentence
        self.collator = make_collator(self.tokenizer, isolate_packed=bool(cfg.data.packing))
        self.prompts = load_prompts(cfg.eval)
        self.stop_ids = stop_token_ids(self.tokenizer, cfg.data.end_of_conversation_token)
        self.total_steps = total_steps(len(self.data.train), cfg, self.world)
        self.steps_per_epoch = steps_per_epoch(len(self.data.train), cfg, self.world)
        warmup = warmup_steps(cfg, self.total_steps)
        hidden = hidden_size_of(model_config)
        facts = RunFacts(self.world, hidden, self.total_steps, warmup, self.precision, str(self.run_dir))
        self.ds_config = resolve_ds_config(cfg, facts)
        if self.is_main:
            for note in replaced_by_config_file(cfg, facts):
                log.warning(note)
        register_secrets(self.ds_config)  # a user's DeepSpeed JSON may hold keys (comet.api_key); DeepSpeed logs it
        self.settings = settings_of(cfg, self.world, self.ds_config, self.precision)
        check_deepspeed_config(self.ds_config, cfg.deepspeed.config_file)
        self.zero_stage = int(self.ds_config["zero_optimization"]["stage"])
        if self.is_main:
            write_json_atomic(self.run_dir / "ds_config.json", redact(self.ds_config))
        self.built = build_model(cfg, self.tokenizer, self.ds_config)
        self.num_parameters = sum(numel(p) for p in self.built.model.parameters())
        self.num_trainable = sum(numel(p) for p in self.built.model.parameters() if p.requires_grad)
        lora = self.built.lora
        log.info(
            "model: %s, %s parameters, %s trainable (%.2f%%)%s",
            cfg.model.name_or_path or f"{cfg.model.name} (built from model.arch)",
            f"{self.num_parameters:,}",
            f"{self.num_trainable:,}",
            100.0 * self.num_trainable / max(self.num_parameters, 1),
            f", LoRA rank {lora.dim} on {len(lora.targets)} layers" if lora else "",
        )
        self.flops = flops_model(self.built.model, self.built.config)
        self.device_name = device_name(self.accelerator)
        self.peak_flops = peak_flops(self.device_name, self.precision, cfg.train.peak_tflops)
        self.check_disk_space()
        engine = build_engine(
            cfg,
            self.built.model,
            self.ds_config,
            total_steps=self.total_steps,
            warmup_steps=warmup,
            accelerator=self.accelerator,
        )
        self.engine, self.metric_scheduler, self.optimizer_name = (
            engine.engine,
            engine.metric_scheduler,
            engine.optimizer,
        )
        self.device = self.engine.device
        if cfg.train.compile:
            self.engine.compile()  # torch.compile of the wrapped module, DeepSpeed's hooks kept working

    def check_disk_space(self) -> None:
        """Collective: rank 0 checks that a checkpoint and the export fit on their disks, every rank obeys."""
        import torch.distributed as dist

        from ds_exp.export import check_target
        from ds_exp.storage import check_free_space, export_bytes

        train_cfg, verdict = self.cfg.train, [None]
        if self.is_main:
            needs: dict[Path, int] = {}
            keys: dict[Path, str] = {}
            if train_cfg.save_every or train_cfg.save_final_checkpoint:
                path = self.run_dir / train_cfg.checkpoint_dir
                needs[path] = self.checkpoint_bytes()
                keys[path] = "train.checkpoint_dir"
            if train_cfg.export:
                path = self.run_dir / train_cfg.export_dir
                needs[path] = export_bytes(self.num_parameters, self.precision)
                keys[path] = "train.export_dir"
            try:
                check_free_space(needs, keys)
                if train_cfg.export:
                    check_target(self.run_dir / train_cfg.export_dir)  # fail now, not after the training
            except RunFailed as err:
                verdict = [str(err)]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise RunFailed(verdict[0])

    def checkpoint_bytes(self) -> int:
        from ds_exp.storage import checkpoint_bytes

        return checkpoint_bytes(self.num_parameters, self.num_trainable, self.precision)

    # ------------------------------------------------------------------ loop
    def train_step(self, batches: list[dict[str, Any]], previous_loss: Any) -> tuple[StepVotes, Any]:
        """One optimizer step over `accumulation` micro batches; adds this rank's sums to `self.window`.

        The step's only collective of its own sums the label tokens of the global batch (the loss is divided by
        them), this rank's stop vote and whether its previous step's loss was non-finite. It is started before
        the first forward and awaited before the first backward, so its latency hides behind the forward, and
        every rank gets the same votes after the same step. Returns them and this rank's summed loss (a tensor)."""
        import torch
        import torch.distributed as dist

        engine, window = self.engine, self.window
        scale = self.world * len(batches)  # undoes DeepSpeed's mean over ranks and micro batches
        # reading the previous step's loss here costs nothing: that step has finished on every device by now
        previous_non_finite = previous_loss is not None and not bool(torch.isfinite(previous_loss))
        labels_per_batch = [label_tokens(b) for b in batches]
        local = [float(sum(labels_per_batch)), float(self.stop.requested), float(previous_non_finite)]
        reduced = torch.tensor(local, dtype=torch.float64, device=self.device)
        pending = dist.all_reduce(reduced, async_op=True)
        votes: StepVotes | None = None
        step_loss: Any = 0.0
        window.label_tokens += sum(labels_per_batch)
        for batch in batches:
            tokens = input_tokens(batch)
            window.input_tokens += tokens
            window.samples += batch["input_ids"].size(0)
            window.flops += self.flops.per_batch(tokens, sum_squared_lengths(batch))
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            out = engine(**model_inputs(batch), use_cache=False)
            summed, _ = token_loss_sum(out.logits, batch["labels"])
            if votes is None:
                pending.wait()
                votes = StepVotes(*reduced.tolist())
                if votes.global_label_tokens == 0:
                    raise RunFailed(
                        "a training batch holds no label tokens: check data.max_seq_len and data.train_on_prompt"
                    )
            engine.backward(summed * (scale / votes.global_label_tokens))
            engine.step()
            step_loss = step_loss + summed.detach()
        # the loss scaler (fp16) skips the update of a step whose gradients overflowed
        self.skipped_steps += not engine.was_step_applied()
        window.loss_sum = window.loss_sum + step_loss
        window.steps += 1
        assert votes is not None
        return votes, step_loss

    def evaluate(self) -> dict[str, float]:
        """Exact over the whole eval set: summed token losses / label tokens, reduced over ranks. Ranks with
        fewer examples run masked batches so that ZeRO-3's collective forwards stay in step."""
        import torch

        eval_ds = self.data.eval
        micro = self.cfg.train.eval_micro_batch_size or self.cfg.train.micro_batch_size
        mine = list(range(self.rank, len(eval_ds), self.world))
        batches = math.ceil(math.ceil(len(eval_ds) / self.world) / micro)
        loss_sum = tokens = 0.0
        self.engine.eval()
        with torch.no_grad():
            for i in range(batches):
                chunk = mine[i * micro : (i + 1) * micro]
                batch = self.collator([eval_ds[j] for j in (chunk or [0])])
                if not chunk:
                    batch["labels"].fill_(IGNORE_INDEX)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                out = self.engine(**model_inputs(batch), use_cache=False)
                summed, count = token_loss_sum(out.logits, batch["labels"])
                loss_sum += float(summed)
                tokens += float(count)
        self.engine.train()
        loss_sum, tokens = all_reduce_sum([loss_sum, tokens], self.device)
        eval_loss = loss_sum / max(tokens, 1.0)
        return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 700.0)), "eval_tokens": tokens}

    def run(self) -> dict[str, Any]:
        from torch.utils.data import DataLoader
        from tqdm.auto import tqdm

        from ds_exp.data import ResumableDistributedSampler

        cfg, train_cfg = self.cfg, self.cfg.train
        micro, accum = train_cfg.micro_batch_size, train_cfg.gradient_accumulation_steps
        self.checkpoint_dir = self.run_dir / train_cfg.checkpoint_dir
        # a submitit job that SLURM requeued runs again in the same directory: it must continue, not restart
        resume = cfg.resume if cfg.resume is not None or self.launch.launcher != "submitit" else "auto"
        resume_from = checkpoint.find_resume_checkpoint(resume, self.run_dir, train_cfg.checkpoint_dir)
        if resume_from is not None:
            check_resume(cfg, resume_from, self.settings)  # also where Hydra's callback did not run (submitit)
            state = checkpoint.load(self.engine, resume_from, rank=self.rank)
            if state.step >= self.total_steps:
                raise NothingToDo(f"{self.run_dir} is complete at step {state.step} of {self.total_steps}")
        else:
            state = checkpoint.TrainState()
            if resume is not None and self.is_main:
                moved = set_aside_attempt(self.run_dir)  # an attempt that left no checkpoint: start over beside it
                if moved is not None:
                    log.warning(
                        "no complete checkpoint to resume from: starting over; the files of the attempt "
                        "before are in %s",
                        moved,
                    )
        self.run_id = state.run_id or self.new_run_id()
        self.wandb = WandbRun(cfg, self.run_dir, enabled=self.is_main, run_id=state.wandb_run_id)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.is_main)
        progress = self.progress = Progress(state.step, state.epoch, state.step_in_epoch)
        if resume_from is not None:
            progress.last_save_step = state.step  # that checkpoint exists: it is never written again
        self.results: dict[str, Any] = {"resumed_from": str(resume_from) if resume_from else None}

        if train_cfg.eval_at_start and progress.step == 0:
            self.results["initial"] = self.record_eval(progress)
        if progress.step == 0:
            self.record_generations(progress.step)  # what the model says before training
        sampler = ResumableDistributedSampler(
            len(self.data.train),
            rank=self.rank,
            world_size=self.world,
            seed=train_cfg.seed,
            shuffle=True,
            drop_last=True,
        )
        bar = tqdm(
            total=self.total_steps,
            initial=progress.step,
            desc="train",
            disable=not self.is_main,
            dynamic_ncols=True,
            mininterval=1.0,
        )
        self.start_loop(state)
        if train_cfg.keep_last == 0 and self.is_main:
            log.warning("train.keep_last=0: no checkpoint is ever deleted (every one saved is kept)")
        self.stop.immediate = False  # from here a signal is voted on and answered with a checkpoint
        (stop_votes,) = all_reduce_sum([float(self.stop.requested)], self.device)
        if stop_votes:  # a signal during setup: nothing trained since the last checkpoint
            raise StopRequested(self.stop.reason, progress.step, None, self.stop.stopped_status)
        while progress.step < self.total_steps:
            sampler.set_epoch(progress.epoch)
            sampler.set_start(progress.step_in_epoch * micro * accum * self.world)  # counted over all ranks
            loader = iter(
                DataLoader(self.data.train, batch_size=micro, sampler=sampler, collate_fn=self.collator, drop_last=True)
            )
            while progress.step_in_epoch < self.steps_per_epoch and progress.step < self.total_steps:
                started = time.perf_counter()
                batches = [next(loader) for _ in range(accum)]
                self.optimizer_step(batches, progress, bar, started)
            if progress.step_in_epoch >= self.steps_per_epoch:
                progress.epoch += 1
                progress.step_in_epoch = 0
                if not train_cfg.eval_every and progress.step < self.total_steps:
                    self.record_eval(progress)  # after each epoch
        self.flush_metric_line()
        bar.close()
        if progress.last_eval_step != progress.step:
            self.results["final"] = self.record_eval(progress)
        else:
            self.results["final"] = self.results.get("last_eval", {})
        if self.last_generation_step != progress.step:
            self.record_generations(progress.step)  # and after
        if train_cfg.save_final_checkpoint and progress.last_save_step != progress.step:
            self.save(progress)
        self.results["step"] = progress.step
        self.results["epoch"] = progress.epoch
        if train_cfg.export:
            from ds_exp.data.tokenizer import tokenizer_source
            from ds_exp.export import ExportSpec, export_hf

            export_dir = self.run_dir / train_cfg.export_dir
            spec = ExportSpec(
                model_config=self.built.config,
                base_path=cfg.model.name_or_path,
                base_dtype=self.built.base_dtype,
                base_rows=self.built.base_rows,
                vocab_size=self.built.vocab_size,
                tokenizer_source=tokenizer_source(cfg),
                lora=self.built.lora,
                precision=self.precision,
                dtype=str(plain(train_cfg.export_dtype)),
                trust_remote_code=bool(cfg.model.trust_remote_code),
            )
            export_hf(
                self.engine,
                zero_stage=self.zero_stage,
                spec=spec,
                tokenizer=self.tokenizer,
                export_dir=export_dir,
                save_adapter=train_cfg.export_adapter,
            )
            self.results["export_dir"] = str(export_dir)
        return self.results

    def start_loop(self, state: checkpoint.TrainState) -> None:
        """The loop's running sums, fresh or carried over from a checkpoint."""
        # a resumed window's sums are over all ranks: rank 0 carries them, so the reduction counts them once
        carried = (state.window_loss_sum, state.window_label_tokens) if self.is_main else (0.0, 0.0)
        self.window, self.bad_steps, self.step_loss = Window(*carried), 0, None
        self.train_seconds, self.train_tokens, self.train_samples, self.train_flops = 0.0, 0.0, 0.0, 0.0
        self.skipped_steps = 0
        self.last_generation_step = -1

    def optimizer_step(self, batches: list[dict[str, Any]], progress: Progress, bar: Any, started: float) -> None:
        """One step of the loop: train, then what follows a step (NaN votes, metric line, eval, checkpoint, stop).
        `started` is when fetching its batches began."""
        train_cfg = self.cfg.train
        votes, self.step_loss = self.train_step(batches, self.step_loss)
        self.flush_metric_line()  # the previous step's line: its all-reduce finished during this step
        progress.step += 1
        progress.step_in_epoch += 1
        self.train_seconds += time.perf_counter() - started
        # the votes were cast when this step began: they speak of the step before it
        self.bad_steps = self.bad_steps + 1 if votes.non_finite else 0
        if self.bad_steps:
            self.report_non_finite(progress.step - 1, self.bad_steps)
        if self.metric_scheduler is not None and _schedule_name(self.cfg) == "greedy":
            self.metric_scheduler.step(self.global_step_loss(self.step_loss, batches))
        bar.update(1)
        if progress.step % train_cfg.log_every == 0 or progress.step == self.total_steps:
            self.record_train(progress, bar)
        if train_cfg.eval_every and progress.step % train_cfg.eval_every == 0:
            self.record_eval(progress)
        if train_cfg.save_every and progress.step % train_cfg.save_every == 0:
            self.save(progress)
        if votes.stop:
            if progress.last_save_step != progress.step:
                self.save(progress)
            self.flush_metric_line()
            raise StopRequested(
                self.stop.reason or "a signal on another rank",
                progress.step,
                self.results["checkpoint"],
                self.stop.stopped_status,
            )

    # ------------------------------------------------------------ recording
    def report_non_finite(self, step: int, in_a_row: int) -> None:
        log.warning("step %d: non-finite loss (%d steps in a row)", step, in_a_row)
        max_bad = self.cfg.train.max_bad_steps
        if in_a_row > max_bad:
            raise RunFailed(
                f"{in_a_row} optimizer steps in a row ended with a non-finite loss (last: step {step}); lower "
                f"optimizer.lr or use precision=bf16/fp32 (train.max_bad_steps={max_bad})"
            )

    def global_step_loss(self, step_loss: Any, batches: list[dict[str, Any]]) -> float:
        """The step's loss over all ranks: an extra collective, made only for schedules that need it (greedy)."""
        loss_sum, labels = all_reduce_sum([float(step_loss), float(sum(label_tokens(b) for b in batches))], self.device)
        return loss_sum / max(labels, 1.0)

    def record_train(self, progress: Progress, bar: Any) -> None:
        """Close the metric window that ends here and open the next one; its line is written by
        `flush_metric_line` once its sums over ranks arrive. The next window starts now, so the cost of the
        line is counted in the step time of the steps after it."""
        import torch
        import torch.distributed as dist

        self.flush_metric_line()
        window, now = self.window, time.perf_counter()
        self.window = Window(started=now)
        sums = torch.tensor(
            [float(window.loss_sum), window.label_tokens, window.input_tokens, window.samples, window.flops],
            dtype=torch.float64,
            device=self.device,
        )
        work = dist.all_reduce(sums, async_op=True)
        grad_norm = self.engine.get_global_grad_norm()
        record = {
            "type": "train",
            "step": progress.step,
            "epoch": progress.epoch + progress.step_in_epoch / max(self.steps_per_epoch, 1),
            "lr": self.current_lr(),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "step_time_s": (now - window.started) / max(window.steps, 1),  # wall time per optimizer step
            "peak_memory_bytes": peak_memory_bytes(self.accelerator),
            "skipped_steps": self.skipped_steps,
            "loss_scale": loss_scale(self.engine) if self.precision == "fp16" else None,
        }
        self.pending_line = PendingLine(work, sums, record, max(now - window.started, 1e-9), bar)

    def flush_metric_line(self) -> None:
        """Write the pending metric line (a no-op when there is none)."""
        pending, self.pending_line = self.pending_line, None
        if pending is None:
            return
        pending.work.wait()
        loss_sum, labels, inputs, samples, flops = pending.sums.tolist()
        self.train_tokens += inputs
        self.train_samples += samples
        self.train_flops += flops
        loss = loss_sum / max(labels, 1.0)
        record = {
            **pending.record,
            "loss": loss,
            "tokens_per_s": inputs / pending.elapsed,
            "tokens_per_s_per_device": inputs / pending.elapsed / self.world,
            "samples_per_s": samples / pending.elapsed,
            "tflops_per_device": flops / pending.elapsed / self.world / 1e12,
            "mfu": self.mfu(flops, pending.elapsed),
        }
        step = record["step"]
        self.results["last_train_loss"] = loss
        if record["skipped_steps"] > self.results.get("skipped_steps", 0):
            log.warning(
                "step %d: the fp16 loss scaler skipped %d steps so far (gradient overflow; the scale is lowered)",
                step,
                record["skipped_steps"],
            )
        self.results["skipped_steps"] = record["skipped_steps"]
        self.metrics.write(record)
        self.wandb.log({f"train/{k}": v for k, v in record.items() if k not in ("type", "step")}, step=step)
        postfix = {"loss": f"{loss:.4f}", "lr": f"{record['lr']:.2e}", "tok_s": f"{record['tokens_per_s']:.0f}"}
        if record["mfu"] is not None:
            postfix["mfu"] = f"{record['mfu']:.1%}"
        pending.bar.set_postfix(postfix)
        step_log.info("step %d loss %.5f lr %.3e tokens/s %.0f", step, loss, record["lr"], record["tokens_per_s"])

    def record_eval(self, progress: Progress) -> dict[str, float]:
        self.flush_metric_line()  # keeps metrics.jsonl in step order
        progress.last_eval_step = progress.step
        if len(self.data.eval) == 0:
            return {}  # no eval split (data.eval_fraction=0 and no source has one): nothing to measure
        result = self.evaluate()
        if self.metric_scheduler is not None and _schedule_name(self.cfg) == "reduce_lr_on_plateau":
            self.metric_scheduler.step(result["eval_loss"])
        record = {"type": "eval", "step": progress.step, "epoch": progress.epoch, **result}
        self.metrics.write(record)
        self.wandb.log({"eval/loss": result["eval_loss"], "eval/perplexity": result["perplexity"]}, step=progress.step)
        log.info("eval at step %d: loss %.5f perplexity %.3f", progress.step, result["eval_loss"], result["perplexity"])
        self.results["last_eval"] = result
        if self.cfg.eval.every_eval and progress.step not in (0, self.total_steps):
            self.record_generations(progress.step)
        return result

    def record_generations(self, step: int) -> None:
        """Collective at ZeRO-3. Greedy completions of eval.prompts, written by rank 0 to generations.jsonl, the log
        and wandb."""
        from ds_exp.generate import generate, write_generations

        self.last_generation_step = step
        if not self.prompts:
            return
        self.flush_metric_line()
        completions = generate(
            self.engine,
            self.tokenizer,
            self.prompts,
            template=str(self.data.stats["template"]).split("+")[0],  # blended sources: the first one's
            max_new_tokens=int(self.cfg.eval.max_new_tokens),
            stop_ids=self.stop_ids,
        )
        if completions is None:
            return
        rows = write_generations(self.run_dir / "generations.jsonl", step, self.prompts, completions)
        self.wandb.table("eval/generations", rows, step=step)
        for row in rows:
            log.info("step %d: %r -> %r", step, row["prompt"], row["completion"])

    def save(self, progress: Progress) -> None:
        """Collective checkpoint. The metric window still open travels with it (summed over ranks), so a resumed
        run's next metric line covers the same steps as an uninterrupted run's."""
        self.flush_metric_line()
        window_loss_sum, window_labels = all_reduce_sum(
            [float(self.window.loss_sum), self.window.label_tokens], self.device
        )
        state = checkpoint.TrainState(
            progress.step,
            progress.epoch,
            progress.step_in_epoch,
            self.wandb.run_id,
            window_loss_sum,
            window_labels,
            run_id=self.run_id,
            settings=self.settings,
        )
        try:
            path = checkpoint.save(
                self.engine, self.checkpoint_dir, state, rank=self.rank, keep_last=self.cfg.train.keep_last
            )
        except (OSError, RuntimeError) as exc:
            from ds_exp.storage import save_failure_message

            tag_dir = self.checkpoint_dir / checkpoint.tag_for(progress.step)
            _release_files(exc)
            if self.is_main and not (tag_dir / checkpoint.COMPLETE_MARKER).is_file():
                shutil.rmtree(tag_dir, ignore_errors=True)  # never complete: give its space back
            message = save_failure_message(exc, tag_dir, self.checkpoint_bytes())
            if message is None:
                raise
            raise RunFailed(message) from exc
        progress.last_save_step = progress.step
        self.results["checkpoint"] = str(path)

    def mfu(self, flops: float, seconds: float) -> float | None:
        """Model FLOPs utilization over all ranks; None where the device's peak is unknown (CPUs)."""
        if not self.peak_flops or seconds <= 0:
            return None
        return flops / seconds / (self.peak_flops * self.world)

    def new_run_id(self) -> str:
        """A fresh run's id, the same on every rank (rank 0 draws it)."""
        import uuid

        import torch.distributed as dist

        drawn = [uuid.uuid4().hex]
        dist.broadcast_object_list(drawn, src=0)
        return str(drawn[0])

    def progress_note(self) -> str:
        return f"step {self.progress.step}" if self.progress is not None else "setup"

    def current_lr(self) -> float:
        lrs = self.engine.get_lr()
        return float(lrs[0]) if lrs else float(self.engine.optimizer.param_groups[0]["lr"])


def _release_files(exc: BaseException) -> None:
    """Close the files a failed save left open: the frames of its traceback hold torch.save's writer, and a
    deleted file that is still open keeps its space on the disk."""
    import gc
    import traceback

    seen: BaseException | None = exc
    while seen is not None:
        traceback.clear_frames(seen.__traceback__)
        seen = seen.__cause__ or seen.__context__
    gc.collect()


def loss_scale(engine: Any) -> float | None:
    """The fp16 loss scaler's current scale: DeepSpeed's fp16 optimizers call it cur_scale, its ZeRO optimizers
    loss_scale."""
    optimizer = engine.optimizer
    for name in ("cur_scale", "loss_scale"):
        value = getattr(optimizer, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _schedule_name(cfg: DictConfig) -> str:
    return str(plain(cfg.scheduler.name))


def _choices() -> dict[str, Any]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return dict(HydraConfig.get().runtime.choices)
    except Exception:  # not under Hydra (e.g. called from a test)
        return {}


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Train under whatever launcher started this process; write metrics, summary, checkpoints and export."""
    import torch.distributed as dist

    started = time.time()
    trainer = Trainer(cfg, run_dir)
    status, error, results = "failed", None, {}
    trainer.stop.install()
    try:
        trainer.setup()
        trainer.prepare()
        results = trainer.run()
        status = "completed"
        return results
    except NothingToDo as done:
        status = "unchanged"
        if trainer.is_main:
            print(f"ds_exp: {done}: nothing to do; its checkpoints, export and summary are unchanged")
        return {}
    except StopRequested as stopped:  # every rank agreed and the checkpoint is complete
        status, results, error = stopped_outcome(trainer, stopped)
    except KeyboardInterrupt:
        status, error = "interrupted", "interrupted by the user"
        raise
    except ResumeError as exc:  # refused before anything was loaded or trained: the run's files stay as they were
        status, error = "unchanged", f"{type(exc).__name__}: {exc}"
        raise
    except DsExpError as exc:  # a message for the user (printed by the CLI); the traceback only in the log file
        error = f"{type(exc).__name__}: {exc}"
        file_log.error("run failed", exc_info=True)
        raise
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        stopped = trainer.stop.behind(exc)
        if stopped is not None:  # a library turned the stop into an error of its own (datasets' worker pool)
            status, results, error = stopped_outcome(trainer, stopped)
        elif trainer.world > 1 and is_lost_peer(exc):
            # a rank died or was killed: the others learn it from their next collective and leave at once
            mark_lost_peer()
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            error = (
                f"lost contact with another rank at {trainer.progress_note()} ({first_line}): it died or was "
                f"killed, see the other ranks' logs in {trainer.run_dir / 'logs'}; continue from the last complete "
                f"checkpoint with the same overrides plus hydra.run.dir={trainer.run_dir} resume=auto"
            )
            file_log.error("run failed", exc_info=True)  # the collective's own error, for the log file
            raise RunFailed(error) from exc
        else:
            log.exception("run failed")
            raise
    finally:
        trainer.stop.restore()
        try:
            if status != "unchanged":
                write_summary(trainer, status, error, results, started)
        except OSError as err:  # e.g. a full disk: the run's own error matters more than its summary
            log.error("could not write %s: %s", trainer.run_dir / "summary.json", err)
        wandb = getattr(trainer, "wandb", None)
        if wandb is not None:
            wandb.summary({"status": status})
            wandb.finish(exit_code=0 if status in RESUMABLE_ENDS else 1)
        metrics = getattr(trainer, "metrics", None)
        if metrics is not None:
            metrics.close()
        close_run_logging()
        if status in ("completed", "unchanged") and dist.is_initialized():
            # The process group stays up: the next job of a multirun in this process reuses it (DeepSpeed
            # caches its groups, so a destroyed one cannot be replaced); it is torn down at exit.
            dist.barrier()
        if trainer.rank != 0 and trainer.run_dir != run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)  # the placeholder Hydra made for this rank
    if trainer.is_main:
        print(f"ds_exp: {redact_text(error)}", file=sys.stderr)
    trainer.stop.leave(trainer.rank)


def stopped_outcome(trainer: Trainer, stopped: StopRequested) -> tuple[str, dict[str, Any], str]:
    """(status, results, error) of a run that stopped on a signal."""
    results = {**getattr(trainer, "results", {}), "step": stopped.step}
    error = f"{stopped}; " + (
        "submitit requeues the job, which resumes from it"
        if stopped.status == "requeued"
        else f"continue with the same overrides plus hydra.run.dir={trainer.run_dir} resume=auto"
    )
    return stopped.status, results, error


def write_summary(trainer: Trainer, status: str, error: str | None, results: dict[str, Any], started: float) -> None:
    import torch.distributed as dist

    cfg = trainer.cfg
    peak = peak_memory_bytes(trainer.accelerator)
    peaks: list[Any] = [peak]
    if status in RESUMABLE_ENDS and dist.is_initialized():  # every rank is still here
        peaks = [None] * trainer.world
        dist.all_gather_object(peaks, peak)
    if not trainer.is_main:
        return
    train_seconds = getattr(trainer, "train_seconds", 0.0)
    summary = {
        "status": status,
        "error": redact_text(error) if error else error,  # an exception's text may quote a value
        "run_dir": str(trainer.run_dir),
        "wall_time_s": time.time() - started,
        "world_size": trainer.world,
        "launcher": trainer.launch.launcher,
        "backend": trainer.backend,
        "accelerator": trainer.accelerator,
        "precision": trainer.precision,
        "zero_stage": getattr(trainer, "zero_stage", None),
        "optimizer": getattr(trainer, "optimizer_name", None),
        "choices": _choices(),
        "model": cfg.model.name_or_path or cfg.model.name,
        "lora_dim": cfg.lora.dim,
        "parameters": getattr(trainer, "num_parameters", None),
        "trainable_parameters": getattr(trainer, "num_trainable", None),
        "total_steps": getattr(trainer, "total_steps", None),
        "steps": results.get("step", trainer.progress.step if trainer.progress else None),
        "train_loss": results.get("last_train_loss"),
        "initial_eval": results.get("initial"),
        "final_eval": results.get("final"),
        "tokens_per_s": getattr(trainer, "train_tokens", 0.0) / train_seconds if train_seconds else None,
        "tokens_per_s_per_device": (
            getattr(trainer, "train_tokens", 0.0) / train_seconds / trainer.world if train_seconds else None
        ),
        "samples_per_s": getattr(trainer, "train_samples", 0.0) / train_seconds if train_seconds else None,
        "mfu": trainer.mfu(getattr(trainer, "train_flops", 0.0), train_seconds) if train_seconds else None,
        "device": getattr(trainer, "device_name", None),
        "peak_tflops_per_device": (getattr(trainer, "peak_flops", None) or 0) / 1e12 or None,
        "skipped_steps": getattr(trainer, "skipped_steps", 0),
        "peak_memory_bytes_per_rank": peaks,
        "checkpoint": results.get("checkpoint"),
        "export_dir": results.get("export_dir"),
        "resumed_from": results.get("resumed_from"),
        "restarts": int(os.environ.get("SLURM_RESTART_COUNT") or 0),  # SLURM requeues of this job so far
        "log_file": str(getattr(trainer, "log_file", "")),
    }
    trainer.run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(trainer.run_dir / "summary.json", summary)
    if status == "completed":
        before, after = (_ppl(summary[k]) for k in ("initial_eval", "final_eval"))
        print(
            f"ds_exp: {status} {summary['steps']} steps in {summary['wall_time_s']:.1f}s; "
            f"eval perplexity {before} -> {after}; run directory {trainer.run_dir}"
        )


def _ppl(result: dict[str, float] | None) -> str:
    return f"{result['perplexity']:.3f}" if result else "n/a"
