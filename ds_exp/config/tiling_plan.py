"""The long-context knobs' plan, from the config alone (light: the checks and the memory planner read it before
anything heavy runs): how many MLP slices and loss chunks a run cuts, the same on every rank, and which model
settings change the logits after lm_head (the tiled loss refuses them). The compute is ds_exp/model/tiling.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_exp.config.schema import Config

LOSS_CHUNK_BYTES = 256 * 2**20  # fp32 logits per chunk when model.tiled_loss_tokens is null
# what a model that changes its logits after lm_head calls it (the tiled loss would skip it)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass(frozen=True)
class TilingPlan:
    """How many slices and chunks, fixed for the run (the same on every rank)."""

    mlp_shards: int  # 0 = MLPs untiled
    loss_chunks: int  # 0 = logits computed whole
    offload: bool


def tokens_per_rank(max_seq_len: int, sequence_parallel: int) -> int:
    return -(-int(max_seq_len) // max(int(sequence_parallel), 1))


def plan_tiling(cfg: Config, *, hidden: int, vocab: int) -> TilingPlan:
    """The slice and chunk counts of this run, from the config alone."""
    model = cfg.model
    tokens = tokens_per_rank(cfg.data.max_seq_len, getattr(cfg.dist, "sequence_parallel_size", 1) or 1)
    shards = 0
    if model.tiled_mlp:
        shards = int(model.tiled_mlp_shards or max(1, math.ceil(tokens / max(hidden, 1))))
    chunks = 0
    if model.tiled_loss:
        rows = max(int(cfg.train.micro_batch_size), int(cfg.train.eval_micro_batch_size or 0))
        per_chunk = int(model.tiled_loss_tokens or max(1, LOSS_CHUNK_BYTES // (4 * max(vocab, 1))))
        chunks = max(1, math.ceil(rows * tokens / per_chunk))
    return TilingPlan(mlp_shards=shards, loss_chunks=chunks, offload=bool(model.activation_offload))


def logits_changed_after_head(settings: dict[str, Any] | None) -> str | None:
    """The config key by which a model transforms its logits after lm_head (refused with the tiled loss)."""
    if not settings:
        return None
    for scope in (settings, settings.get("text_config") or {}):
        for key in LOGIT_TRANSFORMS:
            value = scope.get(key) if isinstance(scope, dict) else None
            if value not in (None, 0, 0.0, 1, 1.0, False):
                return f"{key}={value}"
    return None
