"""The trackers' settings checked before anything is loaded: their packages, and an MLflow store MLflow would
refuse. Light: no torch, no deepspeed, no tracker imported."""

from __future__ import annotations

import importlib.util
import os
from urllib.parse import urlsplit

from ds_exp.config.schema import Config

_TRUE = ("1", "true", "yes")


def _file_store_allowed() -> bool:
    return os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in _TRUE


def logger_problems(cfg: Config) -> list[str]:
    """One line per problem of logger.tensorboard / logger.mlflow."""
    problems = []
    tensorboard, mlflow = cfg.logger.tensorboard, cfg.logger.mlflow
    if tensorboard.enabled and importlib.util.find_spec("tensorboardX") is None:
        problems.append(
            "logger.tensorboard.enabled=true: the tensorboardX package is not installed (pip install tensorboardX), "
            "or set logger.tensorboard.enabled=false"
        )
    if tensorboard.dir is not None and not str(tensorboard.dir).strip():
        problems.append("logger.tensorboard.dir is empty: give a directory, or null for <run dir>/tensorboard")
    if not mlflow.enabled:
        return problems
    if importlib.util.find_spec("mlflow") is None:
        problems.append(
            "logger.mlflow.enabled=true: the mlflow package is not installed (pip install mlflow-skinny), "
            "or set logger.mlflow.enabled=false"
        )
    uri = mlflow.tracking_uri
    if uri is not None:
        if not uri.strip():
            problems.append(
                "logger.mlflow.tracking_uri is empty: give a store (sqlite:///path/mlflow.db, http://host:5000) "
                "or null for <run dir>/mlflow.db"
            )
        elif urlsplit(uri).scheme in ("", "file") and not _file_store_allowed():
            problems.append(
                f"logger.mlflow.tracking_uri={uri} is MLflow's file store, which MLflow 3 refuses (maintenance mode): "
                "use a database, e.g. logger.mlflow.tracking_uri=sqlite:////abs/path/mlflow.db, null for "
                "<run dir>/mlflow.db, or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store"
            )
    if mlflow.experiment is not None and not mlflow.experiment.strip():
        problems.append("logger.mlflow.experiment is empty: give a name, or null for experiment_name")
    return problems
