"""The recipe's named points where features act (ds_exp/config/features.py). The recipe calls each once, in order,
on the hooks of every feature that is on (each built with its own settings), with the run as it stands:

    after_model_config  the tokenizer and the model's config are read (no data, no weights)
    planned_writes      before the engine (rank 0): {path: (bytes, key)} it will write, for the disk check
    after_setup         the engine is built, nothing trained yet
    on_branch           a resume abandons a branch (rank 0): the feature's files made on it, set aside with it
    after_step          an optimizer step and what train.* asks after it (evaluation, checkpoint) are done
    at_checkpoint       a checkpoint was saved, complete (every rank)
    after_train         training is over, its final checkpoint saved, the engine still held (every rank)
    after_export        an export was written (every rank, after the export's barrier), called by the exports
    after_release       the engine is released, however the run ended: undo what the feature changed in the process
    after_run           the run is over: work on what it left (scoring an export), never failing the completed run

A hooks class may also act while the model is built (ds_exp/model/hooks.py's ModelHooks), and say what the steps
optimize (`objective`: ds_exp.train.step.Objective, SFT's unless one does), asked before setup.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from ds_exp.train.metrics import Metrics
from ds_exp.train.session import Session
from ds_exp.train.step import SFT, Objective
from ds_exp.train.workload import Workload


@dataclass
class Run:
    """The run as a hook sees it: the process's session and, until the engine is released, what setup built."""

    session: Session
    hooks: RunHooks  # every feature's: the one that exports calls their after_export
    work: Workload | None = None
    run_id: str | None = None  # once started or resumed: the run's identity (ds_exp.resume.store.TrainState.run_id)
    metrics: Metrics | None = None  # while training: the step's metric line, written before long work


class FeatureHooks:
    """A feature's side of the recipe: override the points it acts at; the others do nothing."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    @property
    def merged_exports(self) -> bool:
        """The step exports must hold the merged model, not only a LoRA adapter: after_export reads it."""
        return False

    def after_model_config(self, run: Run, model_config: PretrainedConfig) -> None:
        return None

    def planned_writes(
        self, run: Run, start_step: int, total_steps: int, parameters: int, trainable: int
    ) -> dict[Path, tuple[int, str]]:
        return {}

    def objective(self) -> Objective | None:
        return None

    def after_setup(self, run: Run) -> None:
        return None

    def on_branch(self, run: Run, step: int, *, same_directory: bool) -> list[Path]:
        return []

    def after_step(self, run: Run, step: int) -> None:
        return None

    def at_checkpoint(self, run: Run, step: int, path: Path) -> None:
        return None

    def after_train(self, run: Run) -> None:
        return None

    def after_export(self, run: Run, export: Path, step: int, *, final: bool) -> None:
        return None

    def after_release(self, run: Run) -> None:
        return None

    def after_run(self, run: Run) -> None:
        return None


class RunHooks:
    """The hooks of every feature this run turns on, called in FEATURE_PACKAGES' order at each point."""

    def __init__(self, hooks: list[FeatureHooks]) -> None:
        self.hooks = hooks

    def after_model_config(self, run: Run, model_config: PretrainedConfig) -> None:
        for hook in self.hooks:
            hook.after_model_config(run, model_config)

    def planned_writes(
        self, run: Run, start_step: int, total_steps: int, parameters: int, trainable: int
    ) -> dict[Path, tuple[int, str]]:
        return {
            path: need
            for hook in self.hooks
            for path, need in hook.planned_writes(run, start_step, total_steps, parameters, trainable).items()
        }

    @property
    def merged_exports(self) -> bool:
        return any(hook.merged_exports for hook in self.hooks)

    def objective(self) -> Objective:
        """The objective of the first feature that has one, else SFT's."""
        return next((o for o in (hook.objective() for hook in self.hooks) if o is not None), SFT)

    def after_setup(self, run: Run) -> None:
        for hook in self.hooks:
            hook.after_setup(run)

    def on_branch(self, run: Run, step: int, *, same_directory: bool) -> list[Path]:
        return [path for hook in self.hooks for path in hook.on_branch(run, step, same_directory=same_directory)]

    def after_step(self, run: Run, step: int) -> None:
        for hook in self.hooks:
            hook.after_step(run, step)

    def at_checkpoint(self, run: Run, step: int, path: Path) -> None:
        for hook in self.hooks:
            hook.at_checkpoint(run, step, path)

    def after_train(self, run: Run) -> None:
        for hook in self.hooks:
            hook.after_train(run)

    def after_export(self, run: Run, export: Path, step: int, *, final: bool) -> None:
        for hook in self.hooks:
            hook.after_export(run, export, step, final=final)

    def after_release(self, run: Run) -> None:
        for hook in self.hooks:
            hook.after_release(run)

    def after_run(self, run: Run) -> None:
        for hook in self.hooks:
            hook.after_run(run)
