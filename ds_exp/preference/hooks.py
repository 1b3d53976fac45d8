"""Preference tuning's side of the recipe (ds_exp/train/hooks.py): its objective, and DPO's reference log-probabilities
computed after setup, before a resume loads a checkpoint (ds_exp/preference/reference.py)."""

from __future__ import annotations

import logging

from ds_exp.preference.checks import PreferenceSettings
from ds_exp.preference.objectives import DPO, Reward
from ds_exp.preference.reference import precompute_reference
from ds_exp.train.hooks import FeatureHooks, Run
from ds_exp.train.step import Objective

log = logging.getLogger(__name__)


class PreferenceHooks(FeatureHooks):
    settings: PreferenceSettings

    def objective(self) -> Objective:
        return DPO(self.settings) if self.settings.name == "dpo" else Reward()

    def after_setup(self, run: Run) -> None:
        work, settings = run.work, self.settings
        if work is None or settings.name != "dpo":
            return
        if settings.reference == "adapters_off":
            if run.session.is_main:
                log.info("DPO reference: the starting model, the same weights with the LoRA adapters off")
            return
        micro = int(work.ds_config["train_micro_batch_size_per_gpu"])
        precompute_reference(work, settings, model_path=settings.model_path, micro=micro, is_main=run.session.is_main)
