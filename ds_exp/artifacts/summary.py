"""summary.json: what a run was and how it ended, from an explicit state that the run fills in as it gets there."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig

from ds_exp.config.secrets import redact_text
from ds_exp.core.files import write_json_atomic
from ds_exp.core.status import RESUMABLE_ENDS, RunStatus

# how a run ends with every rank alive and in step: those, or diverged (decided by all ranks together)
EVERY_RANK_ENDS = (*RESUMABLE_ENDS, RunStatus.DIVERGED)


@dataclass
class RunState:
    """Everything summary.json says. Fields are filled by the run as it knows them; None = not reached."""

    run_dir: Path
    launcher: str
    world_size: int
    data_parallel_size: int | None = None  # world size / sequence_parallel_size: the ranks drawing different samples
    sequence_parallel_size: int = 1  # dist.sequence_parallel_size: ranks training each sample together
    started: float = field(default_factory=time.time)
    status: RunStatus = RunStatus.FAILED
    error: str | None = None
    error_kind: str | None = None  # "out_of_memory" when an allocation failed
    backend: str | None = None
    accelerator: str | None = None
    precision: str | None = None
    device: str | None = None  # the GPU's name
    peak_flops: float | None = None  # per device, for MFU
    zero_stage: int | None = None
    optimizer: str | None = None
    model: str | None = None
    lora_dim: int = 0
    parameters: int | None = None
    trainable_parameters: int | None = None
    total_steps: int | None = None
    train_examples: int | None = None  # rows trained on per epoch (after the split; packed rows when packing)
    global_batch_size: int | None = None  # rows per optimizer step: micro batch x accumulation x data-parallel ranks
    peak_lr: float | None = None  # the schedule's highest learning rate (optimizer.lr; the largest parameter group's)
    steps: int | None = None  # optimizer steps done (None: training never started)
    train_loss: float | None = None
    initial_eval: dict[str, float] | None = None
    final_eval: dict[str, float] | None = None
    train_seconds: float = 0.0  # the optimizer steps' wall time (fetching their batches included)
    compile_seconds: float = 0.0  # building (or waiting for) DeepSpeed's ops: once per machine, about a minute
    ready_seconds: float | None = None  # from the start until training could begin (weights, engine, checkpoint)
    train_tokens: float = 0.0
    train_samples: float = 0.0
    train_flops: float = 0.0
    train_flops_row_attention: float = 0.0  # torchtitan's / llm-foundry's count (ds_exp/train/flops.py)
    compile_s: float | None = None  # torch.compile's time, part of the first steps' (train.compile)
    fast_path: dict[str, Any] | None = None  # attention, Liger's kernels, fused loss, compile: what the run used
    skipped_steps: int = 0
    checkpoint: str | None = None
    export_dir: str | None = None
    resumed_from: str | None = None
    start_step: int = 0  # the step this attempt started from (a resume's checkpoint's; 0: from the start)
    log_file: str | None = None
    # eval.harness: lm-eval's scores of the final export (task -> metric -> value; the base's beside), and how that
    # evaluation ended (completed | failed | interrupted): its own status, a failure never fails the run
    harness: dict[str, dict[str, float | None]] | None = None
    harness_base: dict[str, dict[str, float | None]] | None = None
    harness_status: str | None = None
    harness_error: str | None = None

    def per_second(self, amount: float) -> float | None:
        return amount / self.train_seconds if self.train_seconds else None

    def times(self, total: float) -> dict[str, float]:
        """Where the run's wall time went, adding up to the total: ops, loading, training, evaluating, saving."""
        ready = self.ready_seconds if self.ready_seconds is not None else total
        return {
            "total": total,
            "compile": self.compile_seconds,
            "load": max(ready - self.compile_seconds, 0.0),
            "train": self.train_seconds,
            "evaluate_and_save": max(total - ready - self.train_seconds, 0.0),
        }

    def mfu(self, flops: float) -> float | None:
        if self.peak_flops and self.train_seconds:
            return flops / self.train_seconds / (self.peak_flops * self.world_size)
        return None

    def as_summary(self, peaks: list[int | None]) -> dict[str, Any]:
        wall = time.time() - self.started
        mfu = self.mfu(self.train_flops)
        tokens_per_s = self.per_second(self.train_tokens)
        return {
            "status": self.status,
            "error": redact_text(self.error) if self.error else self.error,  # an exception's text may quote a value
            "error_kind": self.error_kind,
            "run_dir": str(self.run_dir),
            "wall_time_s": wall,
            "time_s": self.times(wall),
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size or self.world_size // max(self.sequence_parallel_size, 1),
            "sequence_parallel_size": self.sequence_parallel_size,
            "launcher": self.launcher,
            "backend": self.backend,
            "accelerator": self.accelerator,
            "precision": self.precision,
            "zero_stage": self.zero_stage,
            "optimizer": self.optimizer,
            "choices": hydra_choices(),
            "model": self.model,
            "lora_dim": self.lora_dim,
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "total_steps": self.total_steps,
            "train_examples": self.train_examples,
            "global_batch_size": self.global_batch_size,
            "peak_lr": self.peak_lr,
            "overrides": hydra_overrides(),
            "steps": self.steps,
            "train_loss": self.train_loss,
            "initial_eval": self.initial_eval,
            "final_eval": self.final_eval,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size if tokens_per_s is not None else None,
            "samples_per_s": self.per_second(self.train_samples),
            "mfu": mfu,  # ds_exp's count: 6 N + each example's attention
            "mfu_with_attention": self.mfu(self.train_flops_row_attention),  # torchtitan's: 6 N + 12 L d s per token
            "compile_s": self.compile_s,
            "fast_path": self.fast_path,
            "device": self.device,
            "peak_tflops_per_device": (self.peak_flops or 0) / 1e12 or None,
            "skipped_steps": self.skipped_steps,
            "peak_memory_bytes_per_rank": peaks,
            "checkpoint": self.checkpoint,
            "export_dir": self.export_dir,
            "resumed_from": self.resumed_from,
            "start_step": self.start_step,
            "restarts": int(os.environ.get("SLURM_RESTART_COUNT") or 0),  # SLURM requeues of this job so far
            "log_file": self.log_file,
            "harness": self.harness,
            "harness_base": self.harness_base,
            "harness_status": self.harness_status,
            "harness_error": redact_text(self.harness_error) if self.harness_error else None,
        }


def write_summary(state: RunState, peaks: list[int | None]) -> dict[str, Any]:
    """Rank 0 writes <run dir>/summary.json (atomically); returns what it wrote."""
    summary = state.as_summary(peaks)
    state.run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(state.run_dir / "summary.json", summary)
    return summary


def final_line(summary: dict[str, Any]) -> str:
    """The console's last line of a completed run: steps, time, the evaluation before and after, and where it all is."""
    evals = [summary[k] or {} for k in ("initial_eval", "final_eval")]
    name = "reward_accuracy" if any("reward_accuracy" in e for e in evals) else "perplexity"
    before, after = (f"{e[name]:.3f}" if name in e else "n/a" for e in evals)
    steps, start = summary["steps"] or 0, summary.get("start_step") or 0
    done = f"{steps - start} steps ({start + 1}-{steps}, resumed at step {start})" if start else f"{steps} steps"
    return (
        f"ds_exp: {summary['status']} {done} in {time_parts(summary['time_s'])}; "
        f"eval {name.replace('_', ' ')} {before} -> {after}; run directory {shown_path(summary['run_dir'])}"
    )


def time_parts(times: dict[str, float]) -> str:
    """`2m 39s (compile 1m 05s, load 8.1 s, train 80.3 s, evaluate and save 5.4 s)`; compile only from a second."""
    parts = [f"compile {duration(times['compile'])}"] if times["compile"] >= 1 else []
    parts += [f"load {duration(times['load'])}", f"train {duration(times['train'])}"]
    parts.append(f"evaluate and save {duration(times['evaluate_and_save'])}")
    return f"{duration(times['total'])} ({', '.join(parts)})"


def duration(seconds: float) -> str:
    """Seconds as people read them: 42.1 s, 3m 05s, 2h 10m."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def shown_path(path: str | Path) -> str:
    """A path as the console shows it: relative to the working directory when inside it, else as it is."""
    try:
        return str(Path(path).absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def hydra_overrides() -> list[str]:
    """The command line's overrides this run (or sweep job) was started with, secrets blanked; [] outside Hydra."""
    try:
        return [redact_text(str(o)) for o in HydraConfig.get().overrides.task]
    except Exception:  # not under Hydra
        return []


def hydra_choices() -> dict[str, Any]:
    """The config groups' options this run picked (Hydra's runtime choices), {} outside Hydra (tests)."""
    try:
        return dict(HydraConfig.get().runtime.choices)
    except Exception:  # not under Hydra
        return {}
