"""The fast path's entry (ds_exp/config/features.py)."""

from __future__ import annotations

from ds_exp.config.features import Feature
from ds_exp.fast_path.checks import fast_path_problems
from ds_exp.fast_path.settings import FastPathSettings

FEATURE = Feature(
    name="fast_path",
    summary="speed on GPUs: the attention kernel, Liger's kernels and fused loss, compiled decoder layers",
    settings=FastPathSettings.of,
    active=lambda settings: True,  # every run chooses its attention and says what of the path it uses
    problems=lambda settings, facts: fast_path_problems(settings, facts.accelerator),
    hooks="ds_exp.fast_path.hooks:FastPathHooks",
)
