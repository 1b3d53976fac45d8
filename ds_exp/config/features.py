"""The features of ds_exp and the small interface through which the shared layers reach them. A feature is what a user
turns on by name: a package `ds_exp/<name>/` with light `settings.py`, `checks.py` and `feature.py` (`FEATURE`: how it
reads its settings, when it is on, its checks, the dotted name of its hooks), its heavy work and hooks, and its command.
The shared layers import only its `settings` and hand each feature its own settings, never the whole config
(tests/unit/test_structure.py). Light: no torch, no deepspeed."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from ds_exp.config.schema import Config

# Every feature, in the order its checks are said and its hooks run.
FEATURE_PACKAGES: tuple[str, ...] = (
    "ds_exp.fast_path",
    "ds_exp.sequence_parallel",
    "ds_exp.long_context",
    "ds_exp.preference",
    "ds_exp.exports",
    "ds_exp.evaluation",
)


@dataclass(frozen=True)
class CheckFacts:
    """What a feature's checks may know beside its settings: the launch and the merged DeepSpeed config."""

    world_size: int
    accelerator: str
    ds_config: dict[str, Any] = field(default_factory=dict)  # {} where it could not be built (said on its own)
    run_dir: Path | None = None
    optimizer_keys: frozenset[str] = frozenset()  # the DeepSpeed keys the optimizer needs set (its entry's)


@dataclass(frozen=True)
class Feature:
    name: str  # the package's name under ds_exp/
    summary: str  # one line: what it does for a user (docs/architecture.md, the dry run)
    settings: Callable[[Config], Any]  # its own settings: its section of the config (or a view of its keys)
    active: Callable[[Any], bool]  # on for this run (given its settings): only then is its heavy work imported
    problems: Callable[[Any, CheckFacts], list[str]] | None = None  # light checks of its settings, one line each
    hooks: str | None = None  # "module:Class": its FeatureHooks (and ModelHooks: model/hooks.py), given its settings
    # (settings, objective, key): an optuna study's objective that names a number of this feature's summary.json
    # (harness.<task>.<metric>) is one its runs will report, one line per problem
    objective_problems: Callable[[Any, str, str], list[str]] | None = None
    plan: Callable[[Any], list[str]] | None = None  # what a dry run says of it, when it is on (one line each)


@cache
def features() -> tuple[Feature, ...]:
    """Every feature's entry (each package's `feature.FEATURE`), in FEATURE_PACKAGES' order."""
    return tuple(importlib.import_module(f"{package}.feature").FEATURE for package in FEATURE_PACKAGES)


def feature_settings(cfg: Config) -> list[tuple[Feature, Any]]:
    """Every feature beside its own settings, read from the config once: what the functions below are handed."""
    return [(feature, feature.settings(cfg)) for feature in features()]


def feature_problems(found: list[tuple[Feature, Any]], facts: CheckFacts) -> list[str]:
    """Every feature's checks, each given its own settings."""
    return [line for f, settings in found if f.problems is not None for line in f.problems(settings, facts)]


def feature_hooks(found: list[tuple[Feature, Any]]) -> list[Any]:
    """The hooks of every feature that is on, each built with its own settings, in FEATURE_PACKAGES' order."""
    return [load(f.hooks)(settings) for f, settings in found if f.hooks is not None and f.active(settings)]


def objective_problems(found: list[tuple[Feature, Any]], objective: str, key: str) -> list[str]:
    """An objective none of the core's summary numbers (ds_exp/sweeps/optuna_study.py), as the features check it."""
    checks = [(f.objective_problems, settings) for f, settings in found if f.objective_problems is not None]
    return [problem for check, settings in checks for problem in check(settings, objective, key)]


def plan_notes(found: list[tuple[Feature, Any]]) -> list[str]:
    """What the dry run says of the features this run turns on."""
    return [note for f, settings in found if f.plan is not None and f.active(settings) for note in f.plan(settings)]


def load(dotted: str) -> Any:
    """The object a "module:name" string names (a feature's hooks class), imported now."""
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)
