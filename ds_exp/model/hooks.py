"""The model build's named points where features act (beside the recipe's, ds_exp/train/hooks.py), called in order:

before_weights  the config is read, no weights: the attention chosen or wrapped (Ulysses hands back its mpu)
after_weights   the weights are loaded, no LoRA yet: kernels that patch the model's modules (Liger's)
after_wrap      LoRA and checkpointing are on: final checks, the loss inside lm_head, tiling, offload, compile
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from ds_exp.model.head_loss import HeadLoss

Batch = dict[str, torch.Tensor]  # a collated batch (ds_exp.train.collate.SFTCollator), on the host


@dataclass(kw_only=True)
class ModelBuild:
    """What the points read and set: the run's side of the model (the step reads it from BuiltModel)."""

    config: PretrainedConfig  # the model's config (its vocabulary padded once after_weights has run)
    ds_config: dict[str, Any]  # what deepspeed.initialize gets
    attention: str | None  # model.attn_implementation, then as before_weights decides it (None: transformers')
    mpu: ModuleType | None = None  # DeepSpeed's process groups for deepspeed.initialize (sequence parallelism)
    shard: Callable[[Batch], Batch] | None = None  # this rank's part of each collated batch (sequence parallelism)
    loss: HeadLoss | None = None  # the loss computed inside lm_head (fused or tiled); None: from the full logits
    inputs: Callable[[Batch], dict[str, Any]] | None = None  # model inputs read off each host batch (a varlen kernel's)
    fast_path: dict[str, Any] = field(default_factory=dict)  # what of the fast path the model uses (summary.json)
    auto_class: Any = AutoModelForCausalLM  # what transformers builds it as, and the export reloads it as (reward)


class ModelHooks:
    """A feature's side of the model build: override the points it acts at; the others do nothing."""

    def before_weights(self, build: ModelBuild) -> None:
        return None

    def after_weights(self, model: PreTrainedModel, build: ModelBuild) -> None:
        return None

    def after_wrap(self, model: PreTrainedModel | PeftModel, build: ModelBuild) -> None:
        return None
