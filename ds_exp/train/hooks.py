"""The recipe's named points where features act (ds_exp/config/features.py), and the hooks of the features a run
turns on. The recipe calls each point once, in its order; every feature that is on gets its own settings, given when
its hooks are built, and the run as it stands at that point.

    after_setup    the engine is built, nothing trained yet
    at_checkpoint  a checkpoint was saved, complete (every rank)
    after_export   an export was written (rank 0 wrote it; every rank calls, ordered after the export's barrier)
    after_run      the run is over and its engine released: work on what it left (scoring an export), never failing
                   the completed run

A feature may also say what the run's steps optimize (`objective`: ds_exp.train.step.Objective, SFT's unless one
does), asked before setup: the data the run trains on, its loss, its evaluation and its metric lines follow it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_exp.config.features import features, load
from ds_exp.config.schema import Config
from ds_exp.train.session import Session
from ds_exp.train.step import SFT, Objective
from ds_exp.train.workload import Workload


@dataclass
class Run:
    """The run as a hook sees it: the process's session (rank, run directory, summary state) and, until the engine is
    released, what setup built."""

    session: Session
    work: Workload | None = None


class FeatureHooks:
    """A feature's side of the recipe: override the points it acts at; the others do nothing."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def objective(self) -> Objective | None:
        return None

    def after_setup(self, run: Run) -> None:
        return None

    def at_checkpoint(self, run: Run, step: int, path: Path) -> None:
        return None

    def after_export(self, run: Run, export: Path, step: int, *, final: bool) -> None:
        return None

    def after_run(self, run: Run) -> None:
        return None


class RunHooks:
    """The hooks of every feature this run turns on, called in FEATURE_PACKAGES' order at each point."""

    def __init__(self, hooks: list[FeatureHooks]) -> None:
        self.hooks = hooks

    @classmethod
    def of(cls, cfg: Config) -> RunHooks:
        built = []
        for feature in features():
            settings = feature.settings(cfg)
            if feature.hooks is not None and feature.active(settings):
                built.append(load(feature.hooks)(settings))
        return cls(built)

    def objective(self) -> Objective:
        """The objective of the first feature that has one, else SFT's."""
        return next((o for o in (hook.objective() for hook in self.hooks) if o is not None), SFT)

    def after_setup(self, run: Run) -> None:
        for hook in self.hooks:
            hook.after_setup(run)

    def at_checkpoint(self, run: Run, step: int, path: Path) -> None:
        for hook in self.hooks:
            hook.at_checkpoint(run, step, path)

    def after_export(self, run: Run, export: Path, step: int, *, final: bool) -> None:
        for hook in self.hooks:
            hook.after_export(run, export, step, final=final)

    def after_run(self, run: Run) -> None:
        for hook in self.hooks:
            hook.after_run(run)
