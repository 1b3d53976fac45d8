"""Sequence parallelism's entry (ds_exp/config/features.py)."""

from __future__ import annotations

from ds_exp.config.features import Feature
from ds_exp.sequence_parallel.checks import sequence_parallel_problems, zero_problems
from ds_exp.sequence_parallel.settings import SequenceParallelSettings

FEATURE = Feature(
    name="sequence_parallel",
    summary="Ulysses sequence parallelism (DeepSpeed's ALST): N ranks train each row, a slice of its sequence each",
    settings=SequenceParallelSettings.of,
    active=lambda settings: settings.size > 1,
    problems=lambda settings, facts: (
        sequence_parallel_problems(settings, facts.world_size) + zero_problems(settings, facts)
    ),
    hooks="ds_exp.sequence_parallel.ulysses:SequenceParallelHooks",
)
