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

from ds_exp.config.fields import Range, Spec, above, at_least
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
# The fields each rope_type reads (transformers' _validate_<type>_rope_parameters, 4.50-5.24), beside rope_type itself.
# transformers only logs a warning for a field it does not know or a value of the wrong type, and the run trains with
# something else than asked (or fails in the first forward pass): here each is refused, naming the field.
_FACTOR = Spec(range=at_least(1, " (new context / trained context), e.g. factor:4.0"))
_POSITIONS = Spec(whole=True, range=at_least(1, " (the context the model was trained with)"))
_POSITIVE = Spec(range=above(0))
_COMMON = {"rope_theta": _POSITIVE, "partial_rotary_factor": Spec(range=Range(0, 1, low_open=True))}
ROPE_FIELDS: dict[str, dict[str, Spec]] = {
    "default": {},
    "linear": {"factor": _FACTOR},
    "dynamic": {"factor": _FACTOR},
    "yarn": {
        "factor": _FACTOR,
        "original_max_position_embeddings": _POSITIONS,
        "attention_factor": _POSITIVE,
        "beta_fast": _POSITIVE,
        "beta_slow": _POSITIVE,
        "mscale": _POSITIVE,
        "mscale_all_dim": Spec(range=at_least(0)),
        "truncate": Spec(choices=(True, False)),
    },
    "longrope": {
        "short_factor": Spec(range=above(0), each=True),
        "long_factor": Spec(range=above(0), each=True),
        "factor": _FACTOR,
        "attention_factor": _POSITIVE,
        "original_max_position_embeddings": _POSITIONS,
    },
    "llama3": {
        "factor": _FACTOR,
        "original_max_position_embeddings": _POSITIONS,
        "low_freq_factor": _POSITIVE,
        "high_freq_factor": _POSITIVE,
    },
}


def long_context_problems(cfg: Config) -> list[str]:
    return rope_scaling_problems(cfg) + tiling_problems(cfg)


def rope_scaling_problems(cfg: Config) -> list[str]:
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
        not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor >= 1
    ):
        return [f"{shown}: rope_type={rope_type} needs factor >= 1 (new context / trained context), e.g. factor:4.0"]
    problems = rope_field_problems(str(rope_type), scaling)
    if problems:
        return problems
    settings = model_settings(cfg.model) or {}
    found = position_limit(settings) if settings else None
    if found is not None and found[2] == "learned":
        return [
            f"{shown}: the {settings.get('model_type')} model learned a table of absolute positions, it has no rotary "
            "embeddings to scale; remove model.rope_scaling"
        ]
    return []


def rope_field_problems(rope_type: str, scaling: dict[str, Any]) -> list[str]:
    """Each field of model.rope_scaling that its rope_type does not read, or reads as another type or range."""
    fields = {**_COMMON, **ROPE_FIELDS[rope_type]}
    problems = []
    for key, value in scaling.items():
        if key in ("rope_type", "type"):
            continue
        given = f"model.rope_scaling.{key}={value}"
        spec = fields.get(key)
        if spec is None:
            problems.append(
                f"{given}: rope_type={rope_type} has no field {key} (its fields: {', '.join(fields)}); remove it"
            )
        elif value is not None and (problem := spec.problem(value)) is not None:  # null: transformers' default
            problems.append(f"{given}: {problem}")
    low, high = scaling.get("low_freq_factor"), scaling.get("high_freq_factor")
    if rope_type == "llama3" and not problems and low is not None and high is not None and high <= low:
        problems.append(  # llama3's wavelength bands would be empty; transformers only warns
            f"model.rope_scaling.high_freq_factor={high}: must be greater than low_freq_factor={low} (llama3's "
            "defaults are 4.0 and 1.0)"
        )
    return problems


def tiling_problems(cfg: Config) -> list[str]:
    """The tiling knobs (ds_exp/model/tiling.py): counts that exist, offload of something checkpointing keeps, a loss
    the model computes from lm_head's output as is."""
    problems = []
    model = cfg.model
    for key in ("tiled_mlp_shards", "tiled_loss_tokens"):
        value = getattr(model, key)
        if value is not None and value < 1:
            problems.append(f"model.{key}={value}: must be >= 1, or null to derive it")
    tokens = tokens_per_rank(cfg.data.max_seq_len, cfg.dist.sequence_parallel_size)
    shards = model.tiled_mlp_shards
    if model.tiled_mlp and shards is not None and shards > tokens >= 1:
        problems.append(
            f"model.tiled_mlp_shards={shards} is more than the {tokens} tokens a rank holds of a row (data.max_seq_len="
            f"{cfg.data.max_seq_len}{_per_rank(cfg)}): every tile past the {tokens}th would be empty; give at most "
            f"{tokens}, or null to derive it from the hidden size"
        )
    if model.activation_offload and not model.gradient_checkpointing:
        problems.append(
            "model.activation_offload=true keeps what activation checkpointing saves (each layer's input) in host "
            "memory, and checkpointing is off: add model.gradient_checkpointing=true"
        )
    if model.tiled_loss:
        transform = logits_changed_after_head(model_settings(cfg.model))
        if transform is not None:
            problems.append(
                f"model.tiled_loss=true: this model changes its logits after lm_head ({transform}), which a loss "
                "computed in chunks of lm_head's output would skip; set model.tiled_loss=false"
            )
    return problems


def _per_rank(cfg: Config) -> str:
    n = cfg.dist.sequence_parallel_size
    return f" over dist.sequence_parallel_size={n}" if isinstance(n, int) and n > 1 else ""
