"""Hydra callback of a single run (conf/config.yaml hydra.callbacks): the run directory's checks."""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ds_exp.core.errors import DsExpError
from ds_exp.launch.console import report_user_error
from ds_exp.launch.run_dir import check_run_start


class CheckRunDir(Callback):
    """Hydra callback: run_dir's checks before Hydra creates the run directory or writes into it (a sweep's
    directory is checked by ds_exp.sweeps.callbacks.ValidateSweep)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        exit_on_error(lambda: check_run_start(config))


def exit_on_error(check: Any) -> None:
    """Run a check from a Hydra callback: a user error ends the process (Hydra only warns about what a callback
    raises)."""
    try:
        check()
    except DsExpError as err:
        report_user_error(err)
        raise SystemExit(err.exit_code) from None
