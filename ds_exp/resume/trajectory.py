"""What a resume with changed settings does to the run's course, said before it happens: length, learning rate, schedule
and warmup may change (the schedule is recomputed); the global batch and the data cannot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ds_exp.config.batch import global_batch_size
from ds_exp.config.plan import scheduler_kwargs
from ds_exp.config.schema import SchedulerConfig, TrainConfig, plain
from ds_exp.core.errors import ResumeError


def trajectory_of(
    train: TrainConfig,
    sched: SchedulerConfig,
    lr: float,
    *,
    total_steps: int,
    warmup_steps: int,
    world_size: int,
    data_key: str,
) -> dict:
    """What the course of this run depends on, recorded in each checkpoint. `world_size`: the data-parallel size."""
    return {
        "total_steps": total_steps,
        "warmup_steps": warmup_steps,
        "lr": float(lr),
        "scheduler": str(plain(sched.name)),
        "scheduler_kwargs": scheduler_kwargs(sched, total_steps, warmup_steps),  # as the schedule gets them
        "scheduler_owner": str(plain(sched.owner)),
        "global_batch": global_batch_size(train, world_size),
        "data": data_key,
    }


LrAt = Callable[[dict, int], "float | None"]  # a trajectory's learning rate after a step (ds_exp.model.engine.lr_at)


def changes(saved: dict, current: dict, step: int, lr_at: LrAt | None = None) -> tuple[list[str], list[str]]:
    """(what the resume changes, what it cannot change); with `lr_at`, also the next step's learning rate."""
    refused = []
    if saved.get("global_batch") not in (None, current["global_batch"]):
        refused.append(
            f"the global batch is {current['global_batch']} samples, it was {saved['global_batch']}: the position in "
            "the epoch would point at other samples; keep train.micro_batch_size x train.gradient_accumulation_steps "
            f"x world size (/ dist.sequence_parallel_size) = {saved['global_batch']}"
        )
    if saved.get("data") not in (None, current["data"]) and current["data"] is not None:
        refused.append(
            "the training data differ from the checkpoint's (data.*, train.seed or the tokenizer changed, or a data "
            "file's content): the position in the epoch would point into other data; resume with the data it was "
            "written with, or fine-tune its export in a new run (model.name_or_path=<run dir>/hf_model)"
        )
    said = []
    what = {
        "total_steps": ("the run's length (train.max_steps / train.epochs)", "steps"),
        "warmup_steps": ("the warmup (scheduler.warmup_steps / warmup_ratio)", "steps"),
        "lr": ("optimizer.lr", ""),
        "scheduler": ("scheduler.name", ""),
        "scheduler_kwargs": ("scheduler.kwargs", ""),
    }
    for key, (name, unit) in what.items():
        if key in saved and saved[key] != current[key]:
            said.append(
                f"{name}: {saved[key]}{' ' + unit if unit else ''} -> {current[key]}{' ' + unit if unit else ''}"
            )
    if said:
        complete = all(k in saved for k in ("lr", "scheduler", "warmup_steps", "total_steps", "scheduler_kwargs"))
        before = lr_at(saved, step) if lr_at is not None and complete else None
        after = lr_at(current, step) if lr_at is not None else None
        effect = f"the {current['scheduler']} schedule is recomputed over {current['total_steps']} steps"
        if saved.get("total_steps") != current["total_steps"]:
            effect += f" instead of {saved.get('total_steps')}"
        if before is not None and after is not None:
            effect += f"; the learning rate for step {step + 1} is {after:.1e} instead of {before:.1e}"
        said.append(effect)
    return said, refused


def check(
    resume: str | None, saved: dict | None, current: dict, step: int, tag_dir: Path, lr_at: LrAt | None = None
) -> list[str]:
    """Raise ResumeError for what cannot change; return the lines that say what the resume changes."""
    if not saved:
        return []  # written before checkpoints recorded their trajectory
    said, refused = changes(saved, current, step, lr_at)
    if refused:
        raise ResumeError(
            "\n".join(
                [
                    f"resume={resume}: {tag_dir} cannot be continued with these settings:",
                    *(f"- {line}" for line in refused),
                ]
            )
        )
    return said
