"""The exports' entry (ds_exp/config/features.py): their settings as a run's exports read them. Light."""

from __future__ import annotations

from dataclasses import dataclass

from ds_exp.config.features import Feature
from ds_exp.config.schema import LoraConfig, ModelConfig
from ds_exp.exports.settings import ExportSettings


@dataclass(frozen=True)
class RunExportSettings:
    """What a run's exports read: train.export* (`train`), the model and LoRA sections, the end-of-answer token."""

    export: ExportSettings
    model: ModelConfig
    lora: LoraConfig
    end_of_conversation_token: str | None


FEATURE = Feature(
    name="exports",
    summary="Hugging Face exports: at the end and every N steps (LoRA: adapters, merged), python -m ds_exp.export/chat",
    settings=lambda cfg: RunExportSettings(cfg.train, cfg.model, cfg.lora, cfg.data.end_of_conversation_token),
    active=lambda settings: True,  # a resume sets aside an abandoned branch's exports whatever this run exports
    hooks="ds_exp.exports.run:ExportHooks",
)
