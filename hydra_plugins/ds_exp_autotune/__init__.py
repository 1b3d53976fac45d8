"""Hydra instantiates sweepers only from the `hydra_plugins` namespace: this names ds_exp's autotuning sweeper
there (`hydra/sweeper=autotune`, conf/hydra/sweeper/autotune.yaml). The code is in ds_exp/tools/autotune.py.

Hydra imports every plugin module on every start (`--help` included), and the autotuner counts parameters with
the model stack (torch): it is imported when Hydra instantiates the sweeper, never before.
"""

from __future__ import annotations

from typing import Any, NoReturn

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from ds_exp.core import compat


class AutotuneSweeper(Sweeper):
    """ds_exp.tools.autotune.Autotune, under the name Hydra accepts."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        compat.import_deepspeed_without_mlflow()  # DeepSpeed would import all of mlflow (the extra) for nothing
        from ds_exp.tools.autotune import Autotune

        return Autotune(*args, **kwargs)

    # never called: __new__ returns the real sweeper. Defined so that Hydra's plugin scan, which skips abstract
    # classes, registers this name.
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        raise NotImplementedError

    def sweep(self, arguments: list[str]) -> NoReturn:
        raise NotImplementedError
