"""The run's plan, one for every caller (the recipe, dry run, autotune, benchmarks), so what a dry run plans is what
trains: world -> data-parallel size -> steps -> warmup -> DeepSpeed config. Each optimizer step consumes one global
batch; an epoch's incomplete last one is dropped, so steps do not depend on the split over ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_exp.config.batch import data_parallel_size, global_batch_size
from ds_exp.config.ds_config import RunFacts, resolve_ds_config
from ds_exp.config.schema import Config, SchedulerConfig, TrainConfig, plain
from ds_exp.core.errors import ConfigError


@dataclass(frozen=True)
class RunPlan:
    """What a run trains with, decided before anything heavy: its ranks, its steps and its DeepSpeed config."""

    world_size: int
    sequence_parallel_size: int
    data_parallel_size: int  # the ranks that draw different samples: world size / sequence-parallel size
    train_examples: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    facts: RunFacts  # what resolve_ds_config was told
    ds_config: dict[str, Any]  # "auto" filled; a resume through the universal format changes it (recipe)

    @property
    def global_batch_size(self) -> int:
        return int(self.ds_config["train_batch_size"])


def plan_run(
    cfg: Config,
    *,
    world_size: int,
    train_examples: int,
    hidden_size: int | None,
    precision: str,
    run_dir: str | Path,
) -> RunPlan:
    """The chain every caller shares (`train_examples`: the rows after splits); ConfigError where the run cannot be
    planned (fewer examples than a global batch, warmup longer than the run)."""
    sp = max(int(cfg.dist.sequence_parallel_size), 1)
    dp = data_parallel_size(world_size, sp)
    steps = total_steps(train_examples, cfg.train, dp)
    warmup = warmup_steps(cfg.scheduler, steps)
    facts = RunFacts(
        world_size=world_size,
        hidden_size=hidden_size,
        total_steps=steps,
        warmup_steps=warmup,
        precision=precision,
        run_dir=str(run_dir),
        sequence_parallel_size=sp,
    )
    return RunPlan(
        world_size=world_size,
        sequence_parallel_size=sp,
        data_parallel_size=dp,
        train_examples=train_examples,
        steps_per_epoch=steps_per_epoch(train_examples, cfg.train, dp),
        total_steps=steps,
        warmup_steps=warmup,
        facts=facts,
        ds_config=resolve_ds_config(cfg, facts),
    )


def steps_per_epoch(num_train: int, train: TrainConfig, data_parallel: int) -> int:
    """`data_parallel`: the data-parallel size (ds_exp.config.batch.data_parallel_size), not the world size."""
    return num_train // global_batch_size(train, data_parallel)


def total_steps(num_train: int, train: TrainConfig, data_parallel: int) -> int:
    per_epoch = steps_per_epoch(num_train, train, data_parallel)
    if per_epoch == 0:
        raise ConfigError(
            f"the training set has {num_train} examples, fewer than one global batch of "
            f"{global_batch_size(train, data_parallel)} (train.micro_batch_size x train.gradient_accumulation_steps x "
            f"world size {data_parallel}): lower train.micro_batch_size or add data"
        )
    if train.max_steps > 0:
        return int(train.max_steps)
    return per_epoch * train.epochs


def warmup_steps(scheduler: SchedulerConfig, total: int) -> int:
    """The warmup of the run's schedule; ConfigError when the schedule's phases do not fit in the run's steps."""
    if scheduler.warmup_steps > 0:
        if scheduler.warmup_steps > total:
            raise ConfigError(
                f"scheduler.warmup_steps={scheduler.warmup_steps} is longer than the whole run ({total} optimizer "
                "steps): the learning rate would never reach optimizer.lr; lower it, or use scheduler.warmup_ratio"
            )
        warmup = int(scheduler.warmup_steps)
    else:
        warmup = math.ceil(total * scheduler.warmup_ratio)
    problem = decay_problem(scheduler, total, warmup)
    if problem:
        raise ConfigError(problem)
    return warmup


WSD_DECAY_FRACTION = 0.2  # WSD's decay: the last 20% of the steps, as cosine-matching in Hagele et al. 2024


def scheduler_kwargs(scheduler: SchedulerConfig, total: int, warmup: int) -> dict:
    """scheduler.kwargs for get_scheduler: WSD's num_decay_steps `auto` is WSD_DECAY_FRACTION of the run."""
    kwargs = dict(scheduler.kwargs)
    if plain(scheduler.name) == "warmup_stable_decay" and kwargs.get("num_decay_steps", "auto") in ("auto", None):
        kwargs["num_decay_steps"] = max(min(round(total * WSD_DECAY_FRACTION), total - warmup), 0)
    return kwargs


def decay_problem(scheduler: SchedulerConfig, total: int, warmup: int) -> str | None:
    """warmup_stable_decay with a num_decay_steps the run has no room for: the rate would never reach its peak."""
    if plain(scheduler.name) != "warmup_stable_decay":
        return None
    decay = scheduler.kwargs.get("num_decay_steps", "auto")
    if decay in ("auto", None):
        return None
    if not isinstance(decay, int) or isinstance(decay, bool) or decay < 0:
        return f"scheduler.kwargs.num_decay_steps={decay}: give auto (the last 20% of the steps) or a whole number"
    if warmup + decay > total:
        return (
            f"scheduler.kwargs.num_decay_steps={decay} with {warmup} warmup steps does not fit in the run's {total} "
            "optimizer steps: the decay would start before the learning rate reaches optimizer.lr; use "
            f"scheduler.kwargs.num_decay_steps=auto (the last {round(total * WSD_DECAY_FRACTION)}) or at most "
            f"{total - warmup}"
        )
    return None


def eval_interval(train: TrainConfig, per_epoch: int, total: int) -> int:
    """Optimizer steps between evaluations (0: at each epoch's end; the last step always): train.eval_every, else each
    epoch's end within train.max_evals, else every ceil(total / max_evals) steps."""
    if train.eval_every:
        return int(train.eval_every)
    epoch_ends = (total - 1) // max(per_epoch, 1)  # ends of epochs before the last step
    if epoch_ends + 1 <= train.max_evals:
        return 0
    return math.ceil(total / train.max_evals)
