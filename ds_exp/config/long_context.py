"""The long-context knobs (model.rope_scaling, tiled_mlp, tiled_loss, activation_offload), from the config alone:
light, so the checks and the memory planner read them before anything heavy runs.

* The plan (`plan_tiling`): how many MLP slices and loss chunks a run cuts, the same on every rank; and which model
  settings change the logits after lm_head (the tiled loss refuses them). The compute is ds_exp/model/tiling.py.
* The checks (`long_context_problems`): model.rope_scaling against the model's position encoding, and the tiling
  knobs against each other and the model's logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ds_exp.config.model_checks import model_settings, position_limit, rope_scaling_override
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


# -------------------------------------------------------------------------------------------------------------- checks
# transformers' rotary scalings (model.rope_scaling's rope_type)
ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3", "default")


def long_context_problems(cfg: Config) -> list[str]:
    return check_rope_scaling(cfg) + check_long_context(cfg)


def check_rope_scaling(cfg: Config) -> list[str]:
    """model.rope_scaling: a rotary model, a type transformers has, a factor that stretches (transformers checks
    the rest of the keys when it builds the config)."""
    scaling = cfg.model.rope_scaling
    if not scaling:
        return []
    if not isinstance(scaling, dict):
        return [f"model.rope_scaling={scaling}: give a mapping, e.g. model.rope_scaling={{rope_type:yarn,factor:4.0}}"]
    shown = rope_scaling_override(dict(scaling))
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        types = ", ".join(ROPE_SCALING_TYPES)
        return [f"{shown}: name the scaling with rope_type (one of {types}), e.g. rope_type:yarn"]
    if rope_type not in ROPE_SCALING_TYPES:
        return [f"{shown}: rope_type={rope_type} is not one of {', '.join(ROPE_SCALING_TYPES)}"]
    factor = scaling.get("factor")
    if rope_type in ("linear", "dynamic", "yarn", "llama3") and (
        not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1
    ):
        return [f"{shown}: rope_type={rope_type} needs factor >= 1 (new context / trained context), e.g. factor:4.0"]
    settings = model_settings(cfg) or {}
    found = position_limit(settings) if settings else None
    if found is not None and found[2] == "learned":
        return [
            f"{shown}: the {settings.get('model_type')} model learned a table of absolute positions, it has no rotary "
            "embeddings to scale; remove model.rope_scaling"
        ]
    return []


def check_long_context(cfg: Config) -> list[str]:
    """The tiling knobs (ds_exp/model/tiling.py): counts that exist, offload of something checkpointing keeps, a loss
    the model computes from lm_head's output as is."""
    problems = []
    model = cfg.model
    for key in ("tiled_mlp_shards", "tiled_loss_tokens"):
        value = getattr(model, key)
        if value is not None and value < 1:
            problems.append(f"model.{key}={value}: must be >= 1, or null to derive it")
    if model.activation_offload and not model.gradient_checkpointing:
        problems.append(
            "model.activation_offload=true keeps what activation checkpointing saves (each layer's input) in host "
            "memory, and checkpointing is off: add model.gradient_checkpointing=true"
        )
    if model.tiled_loss:
        transform = logits_changed_after_head(model_settings(cfg))
        if transform is not None:
            problems.append(
                f"model.tiled_loss=true: this model changes its logits after lm_head ({transform}), which a loss "
                "computed in chunks of lm_head's output would skip; set model.tiled_loss=false"
            )
    return problems
