"""The typed settings of the trackers beside wandb (logger.tensorboard, logger.mlflow; conf/logger/*.yaml), part of
ds_exp/config/schema.py's LoggerConfig. Light."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TensorBoardConfig:
    enabled: bool = False  # logger=tensorboard turns it on
    dir: str | None = None  # event files; null = <run dir>/tensorboard


@dataclass
class MlflowConfig:
    enabled: bool = False  # logger=mlflow turns it on
    tracking_uri: str | None = None  # null = the project's sqlite:///<launch dir>/outputs/mlflow.db
    experiment: str | None = None  # null = experiment_name
    run_name: str | None = None  # null = the run directory, as a path under outputs/
    tags: dict[str, str] = field(default_factory=dict)
