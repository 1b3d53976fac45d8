"""The global batch: micro x accumulation x data-parallel size samples, one per optimizer step. The data-parallel
size is the world size divided by dist.sequence_parallel_size: a sequence-parallel group trains the same samples."""

from __future__ import annotations

from ds_exp.config.schema import TrainConfig


def data_parallel_size(world_size: int, sequence_parallel_size: int = 1) -> int:
    """The ranks that draw different samples: the N ranks of a sequence-parallel group train the same ones."""
    return max(world_size // max(sequence_parallel_size, 1), 1)


def samples_per_rank(train: TrainConfig) -> int:
    """The samples one data-parallel rank contributes to an optimizer step."""
    return train.micro_batch_size * train.gradient_accumulation_steps


def global_batch_size(train: TrainConfig, data_parallel: int) -> int:
    """The samples of one optimizer step; `data_parallel`: data_parallel_size(). The one home of this formula."""
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
