"""The fast path at the model build's points (ds_exp/model/hooks.py)."""

from __future__ import annotations

import logging
from dataclasses import asdict, replace

from peft import PeftModel
from transformers import PreTrainedModel

from ds_exp.config.precision import detect_accelerator
from ds_exp.core import compat
from ds_exp.core.errors import ConfigError
from ds_exp.fast_path.attention import TAKES_BOUNDARIES, attn_implementation, example_boundaries
from ds_exp.fast_path.compile import compile_decoder_layers
from ds_exp.fast_path.fused_loss import apply_fused_loss
from ds_exp.fast_path.settings import FastPath, FastPathSettings, toggle
from ds_exp.model.hooks import ModelBuild, ModelHooks
from ds_exp.train.hooks import FeatureHooks

log = logging.getLogger(__name__)


class FastPathHooks(FeatureHooks, ModelHooks):
    settings: FastPathSettings
    fast: FastPath  # decided before the weights, then what was applied

    def before_weights(self, build: ModelBuild) -> None:
        settings = self.settings
        build.attention = attn_implementation(settings.attention, build.ds_config, settings.sequence_parallel)
        stage = int(build.ds_config.get("zero_optimization", {}).get("stage", 0))
        self.fast = settings.decide(detect_accelerator(), stage)

    def after_weights(self, model: PreTrainedModel, build: ModelBuild) -> None:
        if self.fast.liger_kernel and not compat.apply_liger_kernels(model):
            if toggle(self.settings.liger_kernel):
                raise ConfigError(
                    f"model.liger_kernel=true: Liger has no kernels for the {build.config.model_type} model family; "
                    "set model.liger_kernel=auto or false"
                )
            self.fast = replace(self.fast, liger_kernel=False)

    def after_wrap(self, model: PreTrainedModel | PeftModel, build: ModelBuild) -> None:
        fast = self.fast
        if fast.fused_loss:  # before the tiled loss, which it replaces (ds_exp/long_context/)
            asked = bool(toggle(self.settings.fused_loss))
            build.loss = apply_fused_loss(model, str(build.config.model_type), asked=asked)
        fast = replace(fast, fused_loss=build.loss is not None)
        if fast.compile:
            fast = replace(fast, compile=compile_decoder_layers(model) > 0)
        if build.attention in TAKES_BOUNDARIES and build.mpu is None:  # sequence parallelism isolates documents itself
            build.inputs = example_boundaries  # packed batches hand a varlen kernel their examples' boundaries
        self.fast, build.fast_path = fast, {"attention": build.attention or "sdpa", **asdict(fast)}
        log.info(
            "fast path: attention %s, Liger kernels %s, fused loss %s, compiled decoder layers %s",
            build.attention or "sdpa (transformers' default)",
            *("on" if on else "off" for on in (fast.liger_kernel, fast.fused_loss, fast.compile)),
        )
