"""The typed options of a run's exports (train.export_dtype, train.export_merged; conf/train/default.yaml), part of
ds_exp/config/schema.py's TrainConfig, and which exports hold the merged model (`merges`). Light."""

from __future__ import annotations

from enum import Enum


class ExportDtype(str, Enum):
    auto = "auto"  # the base checkpoint's dtype, or the training precision where every base weight was trained
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class ExportMerged(str, Enum):
    """With LoRA, which exports hold the merged model beside the adapter (every export writes the adapter)."""

    end = "end"  # the final export (train.export) only; step exports (train.export_every) are adapters
    every = "every"  # every export
    none = "none"  # adapters only: python -m ds_exp.export merges any checkpoint later


def merges(export_merged: ExportMerged | str, lora_dim: int, *, final: bool) -> bool:
    """Whether an export (the final one, or a step export) holds the merged model: always without LoRA; with it, as
    train.export_merged says (the adapter is in every export)."""
    asked = str(getattr(export_merged, "value", export_merged))
    return lora_dim <= 0 or asked == "every" or (final and asked == "end")
