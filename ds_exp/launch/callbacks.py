"""Hydra callback of a single run (conf/config.yaml hydra.callbacks): the run directory's checks."""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ds_exp.launch.console import exit_on_error
from ds_exp.launch.run_dir import check_run_start


class CheckRunDir(Callback):
    """Hydra callback: run_dir's checks before Hydra makes the run directory; whatever they raise stops the process."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        exit_on_error(lambda: check_run_start(config), "checking the run directory")
