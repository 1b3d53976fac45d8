"""The `objective` section (conf/objective/*.yaml): what a run's steps optimize. Light: the standard library only."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from ds_exp.config.fields import Range, above, setting

if TYPE_CHECKING:
    from ds_exp.config.schema import DataConfig  # the schema imports this module


class ObjectiveName(str, Enum):
    sft = "sft"  # next-token loss on the answers (DeepSpeed-Chat step 1)
    dpo = "dpo"  # direct preference optimization on chosen/rejected pairs
    reward = "reward"  # a scalar reward model on chosen/rejected pairs (DeepSpeed-Chat step 2)


class LossType(str, Enum):
    sigmoid = "sigmoid"  # the DPO paper's -log sigmoid(beta h)
    ipo = "ipo"  # IPO: (h / response tokens - 1 / (2 beta))^2, as TRL averages it
    hinge = "hinge"  # SLiC: relu(1 - beta h)


class Reference(str, Enum):
    auto = "auto"  # adapters_off with LoRA, else precomputed
    adapters_off = "adapters_off"  # the same weights with the LoRA adapters disabled: no second copy
    precomputed = "precomputed"  # the starting model's log-probs, computed once before training and cached


@dataclass
class ObjectiveConfig:
    name: ObjectiveName = ObjectiveName.sft
    beta: float = setting(0.1, range=above(0, ", e.g. 0.1"))  # DPO's temperature: how far from the reference
    label_smoothing: float = setting(
        0.0, range=Range(0, 0.5, high_open=True, fix=" (cDPO: the share of pairs assumed flipped)")
    )
    loss_type: LossType = LossType.sigmoid
    reference: Reference = Reference.auto


@dataclass(frozen=True)
class PreferenceSettings:
    """What preference tuning reads of a run: its objective and the keys of other sections it depends on."""

    objective: ObjectiveConfig
    data: DataConfig
    lora_dim: int = 0
    lora_modules_to_save: tuple[str, ...] = ()
    sequence_parallel_size: int = 1
    fused_loss: object = "auto"
    tiled_loss: bool = False
    model_key: str = ""  # the starting model as configured (its section, the seed, the precision)
    model_path: str | None = None  # model.name_or_path: its files are part of the reference's key

    @property
    def name(self) -> str:
        return str(getattr(self.objective.name, "value", self.objective.name))

    @property
    def reference(self) -> str:
        """Where DPO's reference log-probabilities come from (auto decided)."""
        chosen = str(getattr(self.objective.reference, "value", self.objective.reference))
        if chosen == "auto":
            return "adapters_off" if self.lora_dim > 0 else "precomputed"
        return chosen
