"""What a run trains: built once by ds_exp.train.recipe.setup, complete before the training loop sees it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepspeed import DeepSpeedEngine
from transformers import PreTrainedTokenizerBase

from ds_exp.data.pipeline import SFTData
from ds_exp.model.build import BuiltModel
from ds_exp.model.engine import MetricSchedule
from ds_exp.train.collate import SFTCollator
from ds_exp.train.flops import FlopsModel
from ds_exp.train.step import Ranks


@dataclass(frozen=True)
class Workload:
    tokenizer: PreTrainedTokenizerBase
    data: SFTData  # tokenized train / eval sets and their statistics
    collator: SFTCollator
    total_steps: int
    steps_per_epoch: int
    warmup_steps: int
    ds_config: dict[str, Any]  # exactly what deepspeed.initialize received ("auto" filled)
    settings: dict[str, Any]  # what a checkpoint of this run depends on (ds_exp.resume.settings_of)
    trajectory: dict[str, Any]  # what the run's course depends on (ds_exp.resume.trajectory.trajectory_of)
    built: BuiltModel  # the model, its config, LoRA, and what the export needs of the base
    engine: DeepSpeedEngine
    # a schedule stepped with a metric (plateau, greedy), outside the engine
    metric_scheduler: MetricSchedule | None
    schedule_name: str
    flops: FlopsModel
    peak_flops: float | None  # per device, for MFU (None where unknown)
    checkpoint_bytes: int  # about what one checkpoint takes on disk
    # the frozen weights (LoRA's base) as built, which checkpoints leave out and record (ds_exp.checkpoint.frozen)
    base: dict[str, Any] | None = None
    resume_from: Path | None = None  # the checkpoint this run continues (ds_exp.train.recipe.resume_plan)
    # loaded through DeepSpeed's universal format: its layout changed (ds_exp/checkpoint/universal.py)
    universal: bool = False
    ranks: Ranks = Ranks()  # noqa: RUF009 (frozen) this rank's place: its sequence-parallel group, its data-parallel rank

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config["zero_optimization"]["stage"])
