"""An MLflow run on rank 0 through MlflowClient (no global active run: a multirun's jobs never share one), at
logger.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else outputs/mlflow.db in the launch directory; a SQLite store is
opened by one process at a time (`store_opened`). A resume continues the same run. A server gone away costs seconds, not
MLflow's 246 s of retries (SHORT_HTTP), and its errors never show a password."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import mlflow
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from ds_exp.artifacts.trackers.base import TrackedRun, Tracker
from ds_exp.config.secrets import redact, redact_text, register_secrets
from ds_exp.config.trackers import MlflowConfig, without_passwords
from ds_exp.core.errors import RunFailed, first_line
from ds_exp.core.files import json_text
from ds_exp.core.status import RESUMABLE_ENDS, RunStatus
from ds_exp.core.waits import announced, announced_wait
from ds_exp.launch.run_logging import FILE_LOGGER

log = logging.getLogger(__name__)

MAX_PARAM_VALUE = 6000  # MLflow's limits (mlflow.utils.validation)
MAX_TAG_VALUE = 8000
MAX_KEY = 250
BATCH = 100  # params or tags per log_batch
STORE_WAIT_S = 600.0  # another run opening the same SQLite store: its tables take seconds to create
_KEY_CHARS = re.compile(r"[^\w\-. :/]")  # what MLflow allows in a param, metric or tag name


# MLflow retries a request 7 times (246 s for a server gone away, 120 s per answer); ds_exp's calls retry twice and
# wait 20 s, unless the user set these; read by MLflow at each request.
SHORT_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


@contextlib.contextmanager
def short_http_waits() -> Iterator[None]:
    """MLflow's requests inside the block give up in seconds (SHORT_HTTP); the process's environment is restored."""
    added = {name: value for name, value in SHORT_HTTP.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def project_outputs() -> Path:
    """outputs/ of the directory the run was launched from (where Hydra's default run and sweep directories are)."""
    launched_from = get_original_cwd() if HydraConfig.initialized() else os.getcwd()
    return Path(launched_from).resolve() / "outputs"


def default_tracking_uri() -> str:
    """The project's store, logger.mlflow.tracking_uri=null without $MLFLOW_TRACKING_URI: one for every run."""
    return f"sqlite:///{project_outputs() / 'mlflow.db'}"


def default_run_name(run_dir: Path) -> str:
    """The run directory under outputs/ (a sweep's jobs stay apart); elsewhere its name."""
    try:
        return str(run_dir.resolve().relative_to(project_outputs()))
    except ValueError:
        return run_dir.name


@contextlib.contextmanager
def store_opened(store: Path | None) -> Iterator[None]:
    """One process at a time opens a SQLite store (flock): two creating MLflow's tables at once fail (mlflow 3.17)."""
    if store is None:
        yield
        return
    store.parent.mkdir(parents=True, exist_ok=True)
    with store.with_name(f"{store.name}.lock").open("a") as lock:

        def taken() -> bool:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        fix = f"another run holds {lock.name} while it opens the store: let it finish, or stop it"
        announced_wait(f"another run to open the MLflow store {store}", taken, limit_s=STORE_WAIT_S, fix=fix)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def flatten(tree: object, prefix: str = "") -> dict[str, str]:
    """A config as MLflow params: dotted keys, lists as JSON, every value a string within MLflow's limits."""
    if isinstance(tree, dict) and tree:
        out: dict[str, str] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    value = json_text(tree) if isinstance(tree, (dict, list)) or tree is None else str(tree)
    return {_KEY_CHARS.sub("_", prefix)[:MAX_KEY]: value[:MAX_PARAM_VALUE]}


def viewer_line(store: str) -> str:
    """How to look at a local store's runs: MLflow's UI, which only the full `mlflow` package serves (not -skinny)."""
    try:
        importlib.metadata.distribution("mlflow")
        install = ""
    except importlib.metadata.PackageNotFoundError:
        install = "pip install mlflow, then "
    return f"; to look at it: {install}mlflow ui --backend-store-uri {store}"


class _ToRunLog(logging.Handler):
    """MLflow's and alembic's chatter (database migrations, ...) goes to the rank's log file, not the console."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(FILE_LOGGER).handle(record)


class MlflowRun(Tracker):
    name = "MLflow"

    def __init__(self, settings: MlflowConfig, run: TrackedRun, *, run_id: str | None, start_step: int) -> None:
        self.client: Any = None
        self.run_id = run_id
        self.store = None  # the store's file on this machine (a SQLite database), None for a server
        self.uri = settings.tracking_uri or default_tracking_uri()
        if self.uri.startswith("sqlite:///"):
            self.store = Path(self.uri.removeprefix("sqlite:///").split("?")[0]).expanduser()
        password = urlsplit(self.uri).password
        if password:  # a server's basic auth in the URI: never in a log line or a param
            register_secrets({"password": password})
        for library in map(logging.getLogger, ("mlflow", "alembic")):
            library.handlers, library.propagate = [_ToRunLog()], False
        shown = without_passwords(self.uri)
        try:
            remote = urlsplit(self.uri).scheme in ("http", "https")
            bound = "each request gives up within about a minute"
            waiting = announced(f"the MLflow server {shown}", bound=bound) if remote else contextlib.nullcontext()
            with short_http_waits(), waiting, store_opened(self.store):
                self.client = mlflow.MlflowClient(tracking_uri=self.uri)
                name = settings.experiment or run.experiment
                experiment = self._experiment(name, None if settings.tracking_uri else self.store)
                self.run_id = self._continue(run_id, start_step) if run_id else None
                if self.run_id is None:
                    self.run_id = self._create(settings, run, experiment)
                else:
                    self._log_changed_params(run.params, start_step)
        except MlflowException as err:
            first = without_passwords(first_line(err))
            raise RunFailed(
                f"logger.mlflow: MLflow refused the tracking store {shown} ({first}); fix "
                "logger.mlflow.tracking_uri (null = the project's outputs/mlflow.db), or logger.mlflow.enabled=false"
            ) from err
        log.info("mlflow: run %s in %s%s", self.run_id, shown, "" if remote else viewer_line(shown))

    def _experiment(self, name: str, default_store: Path | None) -> str:
        """The experiment's id, created when missing (the project's store keeps its artifacts beside it)."""
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        location = (default_store.parent / "mlartifacts").as_uri() if default_store is not None else None
        try:
            return str(self.client.create_experiment(name, artifact_location=location))
        except MlflowException:  # another run of a shared store created it meanwhile
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _create(self, settings: MlflowConfig, run: TrackedRun, experiment: str) -> str:
        tags = {
            "zero_stage": str(run.zero_stage),
            "precision": run.precision,
            "model": run.model_path,
            "ds_exp.run_dir": str(run.run_dir),
            **{str(k): redact_text(str(v)) for k, v in settings.tags.items()},  # a secret by its shape
        }
        created = self.client.create_run(
            experiment, run_name=settings.run_name or default_run_name(run.run_dir), tags=tags
        )
        run_id = str(created.info.run_id)
        params = [Param(k, v) for k, v in flatten(redact(run.params)).items()]
        for start in range(0, len(params), BATCH):
            self.client.log_batch(run_id, params=params[start : start + BATCH])
        return run_id

    def _continue(self, run_id: str, start_step: int) -> str | None:
        """The checkpoint's run, RUNNING again; None (a new run, said in the log) when this store does not have it."""
        try:
            self.client.get_run(run_id)
        except MlflowException:
            log.warning(
                "mlflow: the checkpoint's run %s is not in %s: logging to a new run",
                run_id,
                without_passwords(self.uri),
            )
            return None
        self.client.update_run(run_id, status="RUNNING")
        history = self.client.get_metric_history(run_id, "train/loss")
        beyond = sorted({m.step for m in history if m.step > start_step})
        if beyond:
            # a hard kill after the last checkpoint: MLflow has no way to delete metric values, so say so
            note = (
                f"metric values at steps {beyond[0]}..{beyond[-1]} come from an attempt killed after its checkpoint "
                f"at step {start_step}; the resumed run logged those steps again"
            )
            self.client.set_tag(run_id, f"ds_exp.resumed_at_step_{start_step}", note)
            log.warning("mlflow: run %s: %s", run_id, note)
        return run_id

    def _log_changed_params(self, params: dict[str, Any], start_step: int) -> None:
        """Params are immutable in MLflow: new keys are logged, changed values are told in one tag."""
        assert self.run_id is not None
        before = self.client.get_run(self.run_id).data.params
        now = flatten(redact(params))
        new = [Param(k, v) for k, v in now.items() if k not in before]
        for start in range(0, len(new), BATCH):
            self.client.log_batch(self.run_id, params=new[start : start + BATCH])
        changed = [f"{k}: {before[k]} -> {v}" for k, v in now.items() if k in before and before[k] != v]
        if changed:
            text = "; ".join(changed)[:MAX_TAG_VALUE]
            self.client.set_tag(self.run_id, f"ds_exp.changed_at_step_{start_step}", text)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.client is None:
            return
        now = int(time.time() * 1000)
        values = [
            Metric(_KEY_CHARS.sub("_", key)[:MAX_KEY], float(value), now, int(step))
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        ]
        if values:
            with short_http_waits():
                self.client.log_batch(self.run_id, metrics=values)

    def table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        """Rows (the generations of one evaluation) as a JSON artifact <key>/step<N>.json."""
        if self.client is not None and rows:
            path = f"{key}/step{int(step):06d}.json"
            with short_http_waits():
                self.client.log_dict(self.run_id, {"step": step, "rows": rows}, path)

    @property
    def location(self) -> str:
        return redact_text(self.uri)

    def artifact(self, name: str, document: dict[str, Any]) -> None:
        """The document as a JSON artifact of the run (summary.json)."""
        if self.client is not None:
            with short_http_waits():
                self.client.log_dict(self.run_id, redact(document), name)

    def close(self, status: RunStatus) -> None:
        """The status as a tag, and the run ended; every call tried, the first failure raised after."""
        if self.client is None:
            return
        client, self.client = self.client, None
        end = (
            "FINISHED"
            if status in (RunStatus.COMPLETED, RunStatus.UNCHANGED)
            else "KILLED"
            if status in RESUMABLE_ENDS
            else "FAILED"
        )
        failed: list[Exception] = []
        calls: list[Callable[[], object]] = [
            lambda: client.set_tag(self.run_id, "ds_exp.status", status),
            lambda: client.set_terminated(self.run_id, status=end),
        ]
        with short_http_waits():
            for call in calls:
                try:
                    call()
                except Exception as err:
                    failed.append(err)
        if failed:
            raise failed[0]

    def abandon(self) -> None:
        """Stop logging (its store failed); the run stays RUNNING in the store, as a killed run's does."""
        self.client = None
