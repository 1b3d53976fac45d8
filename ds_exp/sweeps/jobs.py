"""A sweep's jobs: each one's overrides as Hydra's basic sweeper expands them, and each composed and validated
once before anything is launched (every sweeper comes here: -m, autotune's candidates, an optuna study's trials)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ds_exp.config.schema import to_config
from ds_exp.core import compat
from ds_exp.core.errors import DsExpError
from ds_exp.launch.validation import validate


def sweep_jobs(config: DictConfig) -> list[list[str]] | None:
    """Each job's overrides, as Hydra's basic sweeper will expand them; None for other sweepers."""
    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    params = config.hydra.sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=True) if params else {}
    overrides = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
    return compat.basic_sweep_jobs(overrides)


def check_job(
    loader: Any, config: DictConfig, overrides: list[str], num: int | None = None
) -> tuple[DictConfig | None, list[str]]:
    """One job composed and validated once: (its config, []) or (None, the problems, each naming the job).
    The basic sweeper's jobs come here before any is launched, an optuna study's trials as they are asked for."""
    try:
        cfg = loader.load_sweep_config(config, list(overrides))
        if num is not None:  # as the launcher will set it: hydra.sweep.subdir names the job's directory by it
            with read_write(cfg.hydra), open_dict(cfg.hydra):
                cfg.hydra.job.num = num
        validate(to_config(cfg))
    except DsExpError as err:
        return None, [f"job [{' '.join(overrides)}]: {line}" for line in str(err).splitlines()]
    except Exception as err:  # composition errors (unknown option, wrong type) from Hydra / OmegaConf
        return None, [f"job [{' '.join(overrides)}]: {err}".splitlines()[0]]
    return cfg, []
