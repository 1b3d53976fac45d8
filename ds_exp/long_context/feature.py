"""Long context's entry (ds_exp/config/features.py)."""

from __future__ import annotations

from ds_exp.config.features import Feature
from ds_exp.long_context.checks import long_context_problems
from ds_exp.long_context.settings import LongContextSettings

FEATURE = Feature(
    name="long_context",
    summary="long rows: rotary scaling, tiled MLPs, a tiled loss, activation offload (DeepSpeed's ALST tiling)",
    settings=LongContextSettings.of,
    active=lambda s: s.tiled_mlp or s.tiled_loss or s.activation_offload,
    problems=lambda settings, facts: long_context_problems(settings),
    hooks="ds_exp.long_context.tiling:LongContextHooks",
)
