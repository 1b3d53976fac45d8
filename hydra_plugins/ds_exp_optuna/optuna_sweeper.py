"""ds_exp's optuna sweeper, where Hydra looks for plugins (it instantiates only classes under hydra_plugins.*).

The sweeper itself is ds_exp/sweeps/optuna_study.py. Hydra imports this module on every start (`--help`
included), so optuna (seconds of import) is loaded when Hydra instantiates the sweeper, never before. optuna is an
optional extra (`pip install "ds_exp[optuna]"`): without it, `hydra/sweeper=optuna` is one line naming it.
"""

from __future__ import annotations

from typing import Any, NoReturn

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from ds_exp.config.components import Component
from ds_exp.core.errors import ConfigError
from ds_exp.launch.console import report_user_error

# optuna's SQLite storage runs on SQLAlchemy (2, for ds_exp's study files)
STUDY = Component(
    "optuna", "ds_exp.sweeps.optuna_study:StudySweeper", packages=("optuna", "sqlalchemy"), extra="optuna"
)


class OptunaSweeper(Sweeper):
    """`hydra/sweeper=optuna` (conf/hydra/sweeper/optuna.yaml): ds_exp.sweeps.optuna_study.StudySweeper."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        missing = STUDY.missing_package("hydra/sweeper")
        if missing is not None:  # before Hydra launches anything; its instantiate would wrap an exception
            report_user_error(ConfigError(missing))
            raise SystemExit(ConfigError.exit_code)
        return STUDY.load_builder()(*args, **kwargs)

    # never called: __new__ returns the real sweeper. Defined so that Hydra's plugin scan, which skips abstract
    # classes, registers this name.
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        raise NotImplementedError

    def sweep(self, arguments: list[str]) -> NoReturn:
        raise NotImplementedError
