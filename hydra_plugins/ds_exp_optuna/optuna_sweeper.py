"""ds_exp's optuna sweeper, where Hydra looks for plugins (it instantiates only classes under hydra_plugins.*).

The sweeper itself is ds_exp/sweeps/optuna_study.py. Hydra imports this module on every start (`--help`
included), so optuna (seconds of import) is loaded when Hydra instantiates the sweeper, never before.
"""

from __future__ import annotations

from typing import Any, NoReturn

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class OptunaSweeper(Sweeper):
    """`hydra/sweeper=optuna` (conf/hydra/sweeper/optuna.yaml): ds_exp.sweeps.optuna_study.StudySweeper."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from ds_exp.sweeps.optuna_study import StudySweeper

        return StudySweeper(*args, **kwargs)

    # never called: __new__ returns the real sweeper. Defined so that Hydra's plugin scan, which skips abstract
    # classes, registers this name.
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        raise NotImplementedError

    def sweep(self, arguments: list[str]) -> NoReturn:
        raise NotImplementedError
