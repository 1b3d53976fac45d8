"""Sequence parallelism's settings: a view of dist.sequence_parallel_size and of what its checks and hooks read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_exp.config.model_checks import model_settings
from ds_exp.config.schema import Config


@dataclass(frozen=True)
class SequenceParallelSettings:
    size: int = 1  # dist.sequence_parallel_size: the ranks that train each row together (1 = off)
    attention: str | None = "auto"  # model.attn_implementation: the attention DeepSpeed's Ulysses wraps
    packing: bool = False  # data.packing
    micro_batch_size: int = 1  # train.micro_batch_size: DeepSpeed's Ulysses attention is built for one batch size
    eval_micro_batch_size: int | None = None  # train.eval_micro_batch_size
    model: dict[str, Any] | None = None  # the model's config (model.arch or a local config.json): its heads
    model_from: str = "model.arch"  # where `model` was read, as messages say it

    @classmethod
    def of(cls, cfg: Config) -> SequenceParallelSettings:
        model, train = cfg.model, cfg.train
        keys = (cfg.dist.sequence_parallel_size, model.attn_implementation, cfg.data.packing, train.micro_batch_size)
        where = "model.arch" if model.name_or_path is None else "its config.json"
        return cls(*keys, train.eval_micro_batch_size, model_settings(cfg.model), where)
