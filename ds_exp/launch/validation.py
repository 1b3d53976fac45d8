"""Everything checked before heavy work, in one call: the config's values and combinations, the data config and every
feature's checks, for this launch's world size and accelerator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ds_exp.config.ds_config import check_overrides_obeyed, optimizer_needs
from ds_exp.config.features import CheckFacts, feature_problems, feature_settings
from ds_exp.config.place_checks import chdir_problems
from ds_exp.config.precision import detect_accelerator
from ds_exp.config.schema import Config, to_config
from ds_exp.config.validate import config_problems, value_problems
from ds_exp.core.errors import ConfigError
from ds_exp.data.checks import data_config_problems
from ds_exp.launch.environment import detect_launch


def validate(cfg: Config, accelerator: str | None = None, run_dir: Path | None = None) -> dict[str, Any]:
    """One ConfigError listing every problem, else the merged DeepSpeed config; `run_dir` places absolute outputs."""
    values = value_problems(cfg)  # each value's own problems first: the checks below combine only valid ones
    if values:
        raise ConfigError(values)
    world = detect_launch(cfg.dist).world_size
    accelerator = accelerator or detect_accelerator()
    problems, ds = config_problems(cfg, accelerator=accelerator, world_size=world, run_dir=run_dir)
    problems += data_config_problems(cfg.data)
    needs = frozenset(path for path, *_ in optimizer_needs(cfg.optimizer, ds)) if ds else frozenset()
    facts = CheckFacts(world, accelerator, ds, run_dir, needs)
    problems += feature_problems(feature_settings(cfg), facts)  # each its own settings
    if problems:
        raise ConfigError(problems)
    return ds


def validate_job(composed: DictConfig, overrides: list[str], run_dir: Path | None = None) -> Config:
    """A composed run or sweep job, typed and validated, its overrides ones the run obeys (else IgnoredOverride)."""
    cfg = to_config(composed)
    moved = chdir_problems(cfg, bool(OmegaConf.select(composed, "hydra.job.chdir", default=False)))
    if moved:  # a sweep's job (a single run was refused before Hydra made its directory: launch.run_dir)
        raise ConfigError(moved)
    validate(cfg, run_dir=run_dir)
    check_overrides_obeyed(composed, cfg, list(overrides))
    return cfg
