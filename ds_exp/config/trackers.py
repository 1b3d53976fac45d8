"""The trackers before anything runs: their settings (conf/logger/<name>.yaml), their checks, and the table (TRACKERS)
whose entries own each tracker's facts. A tracker server that does not answer is refused now, not after the engine is
built (MLflow's client retries for 246 s). Light: a package is looked up, never imported. Adding a tracker:
docs/architecture.md."""

from __future__ import annotations

import os
import re
import urllib.request
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple
from urllib.parse import SplitResult, urlsplit

from omegaconf import MISSING

from ds_exp.config.components import Component, table
from ds_exp.config.fields import setting
from ds_exp.config.secrets import redact_text
from ds_exp.core.waits import unreachable

WANDB_DEFAULT_URL = "https://api.wandb.ai"
_PASSWORD_IN_URL = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^\s/:@]*:)[^\s/@]*@")
_TRUE = ("1", "true", "yes")


def without_passwords(text: str) -> str:
    """`text` with each URL's password hidden (its user and host stay) and registered secrets blanked."""
    return redact_text(_PASSWORD_IN_URL.sub(r"\1***@", text))


class Server(NamedTuple):
    """A server a tracker talks to: the setting that names it (as shown: no password), its URL, what to do."""

    setting: str
    url: str
    fix: str


class WandbMode(str, Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.disabled
    project: str = "ds_exp"
    entity: str | None = None
    group: str | None = None  # null = the sweep / experiment name
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    dir: str | None = None  # null = the run directory
    api_key: str | None = None  # null = WANDB_API_KEY or `wandb login`; never written (ds_exp/config/secrets.py)

    def active(self) -> bool:
        return self.mode != WandbMode.disabled

    def problems(self) -> list[str]:
        return []  # the typed schema refuses a mode that does not exist

    def servers(self) -> list[Server]:
        if self.mode != WandbMode.online:
            return []
        base = os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL
        where = f"WANDB_BASE_URL={without_passwords(base)}" if os.environ.get("WANDB_BASE_URL") else base
        fix = "fix WANDB_BASE_URL or the network, or logger.wandb.mode=offline (`wandb sync` uploads the run later)"
        return [Server(f"logger.wandb.mode=online ({where})", base, fix)]


@dataclass
class TensorBoardConfig:
    enabled: bool = False  # logger=tensorboard turns it on
    dir: str | None = None  # event files; null = <run dir>/tensorboard

    def active(self) -> bool:
        return self.enabled

    def problems(self) -> list[str]:
        if self.dir is not None and not str(self.dir).strip():
            return ["logger.tensorboard.dir is empty: give a directory, or null for <run dir>/tensorboard"]
        return []

    def servers(self) -> list[Server]:
        return []


@dataclass
class MlflowConfig:
    enabled: bool = False  # logger=mlflow turns it on
    tracking_uri: str | None = None  # null = the project's sqlite:///<launch dir>/outputs/mlflow.db
    experiment: str | None = None  # null = experiment_name
    run_name: str | None = None  # null = the run directory's name
    tags: dict[str, str] = setting(factory=dict, checked_by="ds_exp.config.trackers (MLflow's tags: text values)")

    def active(self) -> bool:
        return self.enabled

    def problems(self) -> list[str]:
        """A store MLflow would refuse, and names left empty."""
        if not self.enabled:
            return []
        problems = []
        uri = self.tracking_uri
        if uri is not None:
            if not uri.strip():
                problems.append(
                    "logger.mlflow.tracking_uri is empty: give a store (sqlite:///path/mlflow.db, http://host:5000) "
                    "or null for the project's outputs/mlflow.db"
                )
            elif (
                urlsplit(uri).scheme in ("", "file")
                and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in _TRUE
            ):
                problems.append(
                    f"logger.mlflow.tracking_uri={uri} is MLflow's file store, which MLflow 3 refuses (maintenance "
                    "mode): use a database, e.g. logger.mlflow.tracking_uri=sqlite:////abs/path/mlflow.db, null for "
                    "the project's outputs/mlflow.db, or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store"
                )
        if self.experiment is not None and not self.experiment.strip():
            problems.append("logger.mlflow.experiment is empty: give a name, or null for experiment_name")
        return problems

    def servers(self) -> list[Server]:
        uri = self.tracking_uri
        if not (self.enabled and uri and urlsplit(uri).scheme in ("http", "https")):
            return []
        fix = (
            "start the server or fix the URI, or use logger.mlflow.tracking_uri=null (the project's outputs/mlflow.db) "
            "or logger.mlflow.enabled=false"
        )
        return [Server(f"logger.mlflow.tracking_uri={without_passwords(uri)}", uri, fix)]


@dataclass
class LoggerConfig:
    name: str = MISSING  # trackers, any number at once: wandb unless its mode is disabled, the others while enabled
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    deepspeed_monitors: bool = False  # also let DeepSpeed write its csv monitor into the run directory


@dataclass(frozen=True)
class TrackerEntry(Component):
    """A tracker: `builder` (a Tracker), built on rank 0 when its settings (LoggerConfig's field `name`) are active."""

    settings: type = object
    run_id_key: str | None = None  # its run's id in a checkpoint's marker ("trackers": {key: id}); None: none
    logs: str = ""  # what it logs, and where

    def settings_of(self, logger: LoggerConfig) -> Any:
        return getattr(logger, self.name)


# In the order they are built: the one most likely to refuse (a tracking store) first
TRACKERS = table(
    [
        TrackerEntry(
            "mlflow",
            "ds_exp.artifacts.trackers.mlflow:MlflowRun",
            packages=("mlflow", "sqlalchemy", "alembic"),
            extra="mlflow",
            settings=MlflowConfig,
            run_id_key="mlflow",
            logs="metrics by step, generations and summary.json as JSON artifacts, the config as params (credentials "
            "blanked), how the run ended; the project's outputs/mlflow.db unless logger.mlflow.tracking_uri",
        ),
        TrackerEntry(
            "tensorboard",
            "ds_exp.artifacts.trackers.tensorboard:TensorBoardRun",
            packages=("tensorboardX",),
            extra="tensorboard",
            settings=TensorBoardConfig,
            logs="scalar metrics by step, generations, the config and summary.json as text; <run dir>/tensorboard",
        ),
        TrackerEntry(
            "wandb",
            "ds_exp.artifacts.trackers.wandb:WandbRun",
            packages=("wandb",),
            settings=WandbConfig,
            run_id_key="wandb",
            logs="metrics by step, generations as tables, the config (credentials blanked), how the run ended",
        ),
    ]
)


def active_trackers(logger: LoggerConfig) -> list[TrackerEntry]:
    """The trackers a run with these settings builds, in the order it builds them."""
    return [entry for entry in TRACKERS.values() if entry.settings_of(logger).active()]


def logger_problems(logger: LoggerConfig, *, dry_run: bool) -> list[str]:
    """One line per problem of the trackers' settings and packages, then of their servers (not for a dry run)."""
    problems = [line for entry in TRACKERS.values() for line in entry.settings_of(logger).problems()]
    problems += [line for entry in active_trackers(logger) if (line := entry.missing_package("logger"))]
    if not problems and not dry_run:
        problems += tracker_server_problems(logger)
    return problems


def first_hop(url: SplitResult) -> tuple[str, int, str]:
    """(host, port, how it is reached) of the first connection to `url`: its proxy where one applies."""
    port = url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        hop = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return hop.hostname or "", hop.port or 3128, f"through the proxy {hop.hostname}:{hop.port or 3128}"
    return url.hostname or "", port, f"{url.hostname}:{port}"


def tracker_server_problems(logger: LoggerConfig) -> list[str]:
    """One line per tracker server not answering a TCP connection within seconds; every rank checks, so all stop."""
    problems = []
    for key_said, url, fix in [server for entry in TRACKERS.values() for server in entry.settings_of(logger).servers()]:
        try:
            host, port, how = first_hop(urlsplit(url))
        except ValueError as err:  # a port that is not a number
            problems.append(f"{key_said}: not a URL ({without_passwords(str(err))}); {fix}")
            continue
        why = unreachable(host, port)
        if why is not None:
            problems.append(f"{key_said}: the server cannot be reached ({how}: {why}); {fix}")
    return problems
