"""Step arithmetic shared by the dry run and the trainer.

Every optimizer step consumes exactly one global batch (micro x accumulation x data-parallel size samples); an
incomplete global batch at the end of an epoch is dropped, so the step count and the samples of each step do
not depend on how the global batch is split over ranks and micro batches. The data-parallel size is the world size
divided by dist.sequence_parallel_size: the ranks of a sequence-parallel group train the same samples together.
"""

from __future__ import annotations

import math

from ds_exp.config.schema import SchedulerConfig, TrainConfig, plain
from ds_exp.core.errors import ConfigError


def data_parallel_size(world_size: int, sequence_parallel_size: int = 1) -> int:
    """The ranks that draw different samples: the N ranks of a sequence-parallel group train the same ones."""
    return max(world_size // max(sequence_parallel_size, 1), 1)


def samples_per_rank(train: TrainConfig) -> int:
    """The samples one data-parallel rank contributes to an optimizer step."""
    return train.micro_batch_size * train.gradient_accumulation_steps


def global_batch_size(train: TrainConfig, data_parallel: int) -> int:
    """The samples of one optimizer step. `data_parallel`: data_parallel_size(), which is the world size without
    sequence parallelism. The one home of this formula: DeepSpeed's train_batch_size, the trajectory's
    global_batch, the resume checks and the parity checker all come from it."""
    return samples_per_rank(train) * data_parallel


def global_batch_mismatch(train: TrainConfig, world: int, sequence_parallel_size: int = 1) -> str:
    """train.global_batch_size names a world size other than this launch's."""
    per_rank = samples_per_rank(train)
    fits = train.global_batch_size / per_rank
    if sequence_parallel_size > 1:
        n = sequence_parallel_size
        where = f"holds only at {fits:g} data-parallel ranks" if fits == int(fits) else "holds at no world size"
        return (
            f"train.global_batch_size={train.global_batch_size} {where} (micro {train.micro_batch_size} x "
            f"accumulation {train.gradient_accumulation_steps} x data-parallel ranks), and this launch has {world} "
            f"rank(s) = {data_parallel_size(world, n)} data-parallel x dist.sequence_parallel_size={n}: use "
            "train.global_batch_size=auto, or change train.micro_batch_size / gradient_accumulation_steps"
        )
    where = f"holds only at world size {fits:g}" if fits == int(fits) else "holds at no world size"
    return (
        f"train.global_batch_size={train.global_batch_size} {where} (micro {train.micro_batch_size} x accumulation "
        f"{train.gradient_accumulation_steps} x world size), and this launch has {world} rank(s): use "
        "train.global_batch_size=auto, or change train.micro_batch_size / gradient_accumulation_steps"
    )


def steps_per_epoch(num_train: int, train: TrainConfig, world_size: int) -> int:
    return num_train // global_batch_size(train, world_size)


def total_steps(num_train: int, train: TrainConfig, world_size: int) -> int:
    """`world_size`: the data-parallel size (see global_batch_size)."""
    per_epoch = steps_per_epoch(num_train, train, world_size)
    if per_epoch == 0:
        raise ConfigError(
            f"the training set has {num_train} examples, fewer than one global batch of "
            f"{global_batch_size(train, world_size)} (train.micro_batch_size x train.gradient_accumulation_steps x "
            f"world size {world_size}): lower train.micro_batch_size or add data"
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
    """scheduler.kwargs as transformers.get_scheduler gets them: warmup_stable_decay's num_decay_steps `auto` (or
    absent) becomes the last WSD_DECAY_FRACTION of the run's steps, within what the warmup leaves."""
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
    """Optimizer steps between evaluations during training, 0 = at the end of each epoch (the run's last step is
    always evaluated). train.eval_every when set. With eval_every=0, each epoch's end while that keeps the run
    within train.max_evals evaluations (the one before training aside, the last one's included); a run of more,
    shorter epochs (a small data set, or train.max_steps past an epoch) evaluates every ceil(total / max_evals)
    steps instead, so that a 15-step run on a tiny data set does not spend its time evaluating."""
    if train.eval_every:
        return int(train.eval_every)
    epoch_ends = (total - 1) // max(per_epoch, 1)  # ends of epochs before the last step
    if epoch_ends + 1 <= train.max_evals:
        return 0
    return math.ceil(total / train.max_evals)
