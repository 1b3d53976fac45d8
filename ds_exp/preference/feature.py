"""Preference tuning's entry (ds_exp/config/features.py): on for objective=dpo or reward."""

from __future__ import annotations

from ds_exp.config.features import Feature
from ds_exp.config.schema import Config, as_dict
from ds_exp.data.cache import hash_key
from ds_exp.preference.checks import PreferenceSettings, preference_problems


def settings_of(cfg: Config) -> PreferenceSettings:
    identity = {"model": as_dict(cfg)["model"], "seed": cfg.train.seed, "precision": str(cfg.precision.dtype)}
    return PreferenceSettings(
        objective=cfg.objective,
        data=cfg.data,
        lora_dim=int(cfg.lora.dim),
        lora_modules_to_save=tuple(cfg.lora.modules_to_save),
        sequence_parallel_size=int(cfg.dist.sequence_parallel_size),
        fused_loss=cfg.model.fused_loss,
        tiled_loss=bool(cfg.model.tiled_loss),
        model_key=hash_key(identity),
        model_path=cfg.model.name_or_path,
        harness_tasks=tuple(cfg.eval.harness.tasks),
    )


def plan(settings: PreferenceSettings) -> list[str]:
    reference = {
        "adapters_off": "the same weights with the LoRA adapters off (no second copy, a no-grad forward)",
        "precomputed": "log-probabilities of the starting model, computed once before training and cached beside "
        "the tokenized data (16 bytes a pair; no weights held while training)",
    }
    said = f"objective={settings.name}: each pair is two rows (the activations above count both)"
    return [said + (f"; DPO's reference: {reference[settings.reference]}" if settings.name == "dpo" else "")]


FEATURE = Feature(
    name="preference",
    summary="preference tuning (DeepSpeed-Chat step 2): DPO on chosen/rejected pairs, and reward models",
    settings=settings_of,
    active=lambda settings: settings.name != "sft",
    problems=preference_problems,
    hooks="ds_exp.preference.hooks:PreferenceHooks",
    plan=plan,
)
