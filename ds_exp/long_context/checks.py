"""What long context refuses before anything heavy (light): model.rope_scaling against transformers and the model,
and the tiling knobs against each other and the model's logits."""

from __future__ import annotations

from typing import Any

from ds_exp.config.fields import Range, Spec, above, at_least
from ds_exp.config.model_checks import logits_changed_after_head, position_limit, rope_scaling_override
from ds_exp.long_context.settings import LongContextSettings

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


def long_context_problems(settings: LongContextSettings) -> list[str]:
    return rope_scaling_problems(settings) + tiling_problems(settings)


def rope_scaling_problems(settings: LongContextSettings) -> list[str]:
    """model.rope_scaling: a rotary model, a known type, a factor that stretches (transformers checks the rest)."""
    scaling = settings.rope_scaling
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
    model = settings.model or {}
    found = position_limit(model) if model else None
    if found is not None and found[2] == "learned":
        return [
            f"{shown}: the {model.get('model_type')} model learned a table of absolute positions, it has no rotary "
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


def tiling_problems(settings: LongContextSettings) -> list[str]:
    """The tiling knobs: no more tiles than tokens, offload of what checkpointing keeps, a loss from lm_head."""
    problems = []
    tokens, shards, n = settings.tokens, settings.tiled_mlp_shards, settings.sequence_parallel
    if settings.tiled_mlp and shards is not None and shards > tokens >= 1:
        per_rank = f" over dist.sequence_parallel_size={n}" if n > 1 else ""
        problems.append(
            f"model.tiled_mlp_shards={shards} is more than the {tokens} tokens a rank holds of a row (data.max_seq_len="
            f"{settings.max_seq_len}{per_rank}): every tile past the {tokens}th would be empty; give at most "
            f"{tokens}, or null to derive it from the hidden size"
        )
    if settings.activation_offload and not settings.gradient_checkpointing:
        problems.append(
            "model.activation_offload=true keeps what activation checkpointing saves (each layer's input) in host "
            "memory, and checkpointing is off: add model.gradient_checkpointing=true"
        )
    if settings.tiled_loss:
        transform = logits_changed_after_head(settings.model)
        if transform is not None:
            problems.append(
                f"model.tiled_loss=true: this model changes its logits after lm_head ({transform}), which a loss "
                "computed in chunks of lm_head's output would skip; set model.tiled_loss=false"
            )
    return problems
