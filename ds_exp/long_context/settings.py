"""Long context's settings and the plan of slices and chunks: light, for the checks and the memory planner."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ds_exp.config.model_checks import model_settings
from ds_exp.config.schema import Config

LOSS_CHUNK_BYTES = 256 * 2**20  # fp32 logits per chunk when model.tiled_loss_tokens is null


@dataclass(frozen=True)
class TilingPlan:
    """How many slices and chunks, fixed for the run (the same on every rank)."""

    mlp_shards: int  # 0 = MLPs untiled
    loss_chunks: int  # 0 = logits computed whole
    offload: bool


@dataclass(frozen=True)
class LongContextSettings:
    """The model.* keys where users type them (ranges in ModelConfig), and what the plan and checks read of the rest."""

    rope_scaling: Any = None
    tiled_mlp: bool = False
    tiled_mlp_shards: int | None = None
    tiled_loss: bool = False
    tiled_loss_tokens: int | None = None
    activation_offload: bool = False
    gradient_checkpointing: bool = False  # model.gradient_checkpointing: what the offload moves
    max_seq_len: int = 512  # data.max_seq_len
    sequence_parallel: int = 1  # dist.sequence_parallel_size: each rank holds 1/N of a row
    rows: int = 1  # the most rows of a micro batch, training's or evaluation's: a loss chunk count covers them
    model: dict[str, Any] | None = None  # the model's config (model.arch or a local config.json)

    @classmethod
    def of(cls, cfg: Config) -> LongContextSettings:
        m, train = cfg.model, cfg.train
        tiling = (m.tiled_mlp, m.tiled_mlp_shards, m.tiled_loss, m.tiled_loss_tokens, m.activation_offload)
        sp = int(getattr(cfg.dist, "sequence_parallel_size", 1) or 1)
        rows = max(int(train.micro_batch_size), int(train.eval_micro_batch_size or 0))
        return cls(
            m.rope_scaling, *tiling, m.gradient_checkpointing, cfg.data.max_seq_len, sp, rows, model_settings(cfg.model)
        )

    @property
    def tokens(self) -> int:
        """Of a row, on one rank."""
        return -(-int(self.max_seq_len) // max(self.sequence_parallel, 1))

    def plan(self, *, hidden: int, vocab: int) -> TilingPlan:
        """The slice and chunk counts of this run, from the config alone."""
        shards = chunks = 0
        if self.tiled_mlp:
            shards = int(self.tiled_mlp_shards or max(1, math.ceil(self.tokens / max(hidden, 1))))
        if self.tiled_loss:
            per_chunk = int(self.tiled_loss_tokens or max(1, LOSS_CHUNK_BYTES // (4 * max(vocab, 1))))
            chunks = max(1, math.ceil(self.rows * self.tokens / per_chunk))
        return TilingPlan(mlp_shards=shards, loss_chunks=chunks, offload=self.activation_offload)
