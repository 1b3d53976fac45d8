"""What every tracker is: a run in a tracking store, opened on rank 0 by tracking.Trackers, which guards each call."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ds_exp.config.schema import Config, as_dict, plain
from ds_exp.core.status import RunStatus


@dataclass(frozen=True)
class TrackedRun:
    """What every tracker records of the run beside its own settings (logger.<name>), taken from the config once."""

    run_dir: Path
    experiment: str  # experiment_name: wandb's group and MLflow's experiment, unless their settings name one
    params: dict[str, Any]  # the whole config as plain values; each tracker blanks the credentials as it logs them
    zero_stage: int
    precision: str  # precision.dtype as written
    model: str  # model.name
    model_path: str  # model.name_or_path, or model.name for a model built here

    @classmethod
    def of(cls, cfg: Config, run_dir: Path) -> TrackedRun:
        model = cfg.model
        return cls(
            run_dir,
            experiment=cfg.experiment_name,
            params=as_dict(cfg),
            zero_stage=int(cfg.zero.stage),
            precision=str(plain(cfg.precision.dtype)),
            model=model.name,
            model_path=model.name_or_path or model.name,
        )


class Tracker(abc.ABC):
    """One tracker's run: its settings, the run, the run id a checkpoint kept, the start step."""

    name: ClassVar[str]  # as people read it in messages: "wandb", "TensorBoard", "MLflow"
    store: Path | None = None  # where it writes on this machine (a full disk there is told apart); None: a server
    run_id: str | None = None  # what a checkpoint keeps so a resume continues the run; None: nothing to continue

    @abc.abstractmethod
    def __init__(self, settings: Any, run: TrackedRun, *, run_id: str | None, start_step: int) -> None: ...

    @property
    def location(self) -> str:
        """Where it writes, as a message shows it (no password)."""
        return str(self.store)

    @abc.abstractmethod
    def log(self, metrics: dict[str, Any], step: int) -> None:
        """A metric line at an optimizer step; values that are not numbers are the tracker's to keep or skip."""

    @abc.abstractmethod
    def table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        """Rows of equal keys (the generations of one evaluation) at a step."""

    @abc.abstractmethod
    def artifact(self, name: str, document: dict[str, Any]) -> None:
        """A JSON document the run leaves (summary.json), credentials blanked by the tracker."""

    @abc.abstractmethod
    def close(self, status: RunStatus) -> None:
        """End the run as `status` says (a stop that can be resumed is not a failure)."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """Stop at once, without another write (its store failed, or its disk is full)."""
