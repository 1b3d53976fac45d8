"""The exports' settings: train.export* stay in `train` through ExportSettings, which TrainConfig mixes in. Light."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ds_exp.config.fields import at_least, setting


class ExportDtype(str, Enum):
    auto = "auto"  # the base checkpoint's dtype, or the training precision where every base weight was trained
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class ExportMerged(str, Enum):
    """With LoRA, which exports hold the merged model beside the adapter (every export writes the adapter)."""

    end = "end"  # the final export (train.export) only; step exports (train.export_every) are adapters
    every = "every"  # every export
    none = "none"  # adapters only: python -m ds_exp.export --merged merges any checkpoint later


@dataclass
class ExportSettings:
    export: bool = True
    export_dir: str = "hf_model"  # relative to the run directory
    export_merged: ExportMerged = ExportMerged.end  # with LoRA: which exports hold the merged model (the adapter: all)
    export_every: int = setting(
        0, range=at_least(0)
    )  # optimizer steps between exports <export_dir>-step<N>; 0 = only the final export
    export_keep_last: int = setting(2, range=at_least(0))  # step exports kept (this run's newest); 0 = all
    export_dtype: ExportDtype = ExportDtype.auto  # auto = the base checkpoint's (see ds_exp/exports/writer.py)

    def merges(self, lora_dim: int, *, final: bool) -> bool:
        """Whether an export holds the merged model: always without LoRA; with it, as train.export_merged says."""
        asked = str(getattr(self.export_merged, "value", self.export_merged))
        return lora_dim <= 0 or asked == "every" or (final and asked == "end")
