"""The `objective` section (conf/objective/*.yaml): what a run's steps optimize. Light: the standard library only."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ds_exp.config.fields import Range, above, setting


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
