"""The trackers' settings checked before anything is loaded: their packages, an MLflow store MLflow would refuse,
and the servers they talk to: an MLflow server (logger.mlflow.tracking_uri=http...) or wandb's (an online run,
WANDB_BASE_URL) that does not answer a TCP connection within a few seconds is refused now, instead of after the
model, the data and the engine were built, and MLflow's client had retried for 246 s. What is shown of a URL never
holds its password. Light: no torch, no deepspeed, no tracker imported."""

from __future__ import annotations

import importlib.util
import os
import re
import urllib.request
from urllib.parse import SplitResult, urlsplit

from ds_exp.config.schema import Config, plain
from ds_exp.config.secrets import redact_text
from ds_exp.core.waits import unreachable

_TRUE = ("1", "true", "yes")


def _file_store_allowed() -> bool:
    return os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in _TRUE


def logger_problems(cfg: Config) -> list[str]:
    """One line per problem of the trackers' settings, then of their servers (not asked by a dry run, which logs
    nothing)."""
    problems = _setting_problems(cfg)
    if not problems and not cfg.dry_run:
        problems += tracker_server_problems(cfg)
    return problems


def _setting_problems(cfg: Config) -> list[str]:
    """logger.tensorboard / logger.mlflow."""
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
                "or null for the project's outputs/mlflow.db"
            )
        elif urlsplit(uri).scheme in ("", "file") and not _file_store_allowed():
            problems.append(
                f"logger.mlflow.tracking_uri={uri} is MLflow's file store, which MLflow 3 refuses (maintenance mode): "
                "use a database, e.g. logger.mlflow.tracking_uri=sqlite:////abs/path/mlflow.db, null for "
                "the project's outputs/mlflow.db, or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store"
            )
    if mlflow.experiment is not None and not mlflow.experiment.strip():
        problems.append("logger.mlflow.experiment is empty: give a name, or null for experiment_name")
    return problems


WANDB_DEFAULT_URL = "https://api.wandb.ai"
_PASSWORD_IN_URL = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^\s/:@]*:)[^\s/@]*@")


def without_passwords(text: str) -> str:
    """`scheme://user:password@host` anywhere in `text` with the password hidden (the user and host stay: they say
    which server), and every registered secret blanked."""
    return redact_text(_PASSWORD_IN_URL.sub(r"\1***@", text))


def tracker_servers(cfg: Config) -> list[tuple[str, str, str]]:
    """(the setting, the server's URL, what to do) for each tracker server the run talks to."""
    servers = []
    uri = cfg.logger.mlflow.tracking_uri
    if cfg.logger.mlflow.enabled and uri and urlsplit(uri).scheme in ("http", "https"):
        fix = (
            "start the server or fix the URI, or use logger.mlflow.tracking_uri=null (the project's outputs/mlflow.db) "
            "or logger.mlflow.enabled=false"
        )
        servers.append((f"logger.mlflow.tracking_uri={without_passwords(uri)}", uri, fix))
    if str(plain(cfg.logger.wandb.mode)) == "online":
        base = os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL
        where = f"WANDB_BASE_URL={without_passwords(base)}" if os.environ.get("WANDB_BASE_URL") else base
        fix = "fix WANDB_BASE_URL or the network, or logger.wandb.mode=offline (`wandb sync` uploads the run later)"
        servers.append((f"logger.wandb.mode=online ({where})", base, fix))
    return servers


def first_hop(url: SplitResult) -> tuple[str, int, str]:
    """(host, port, how it is reached) of the first connection to `url`: its proxy where one applies."""
    port = url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        hop = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return hop.hostname or "", hop.port or 3128, f"through the proxy {hop.hostname}:{hop.port or 3128}"
    return url.hostname or "", port, f"{url.hostname}:{port}"


def tracker_server_problems(cfg: Config) -> list[str]:
    """One line per tracker server that does not answer (a TCP connection, a few seconds at most). Every rank
    checks, so that all of them stop (rank 0 alone would leave the others waiting for it at the rendezvous)."""
    problems = []
    for setting, url, fix in tracker_servers(cfg):
        try:
            parts = urlsplit(url)
            host, port, how = first_hop(parts)
        except ValueError as err:  # a port that is not a number
            problems.append(f"{setting}: not a URL ({without_passwords(str(err))}); {fix}")
            continue
        why = unreachable(host, port)
        if why is not None:
            problems.append(f"{setting}: the server cannot be reached ({how}: {why}); {fix}")
    return problems
