"""The long-context knobs before anything runs (issue 24 §2, §3): model.rope_scaling against the model's position
encoding, and the tiling knobs (ds_exp/model/tiling.py) against each other and the model's logits. Light."""

from __future__ import annotations

from ds_exp.config.model_checks import model_settings, position_limit, rope_scaling_override
from ds_exp.config.schema import Config
from ds_exp.config.tiling_plan import logits_changed_after_head

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
