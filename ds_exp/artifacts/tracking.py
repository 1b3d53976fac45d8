"""Where metric lines go: metrics.jsonl and the trackers (rank 0 only; a no-op on the other ranks).

The trackers are wandb (logger.wandb.mode), TensorBoard (logger.tensorboard.enabled) and MLflow
(logger.mlflow.enabled; ds_exp/artifacts/mlflow_run.py), any number at once: `logger=[wandb,tensorboard,mlflow]`.
`Trackers` is what the loop sees: one `log`, `table` and `close` for all of them.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds_exp.artifacts.mlflow_run import MlflowRun
from ds_exp.artifacts.summary import shown_path
from ds_exp.artifacts.tensorboard_run import TensorBoardRun
from ds_exp.config.logger_checks import WANDB_DEFAULT_URL, without_passwords
from ds_exp.config.memory_plan import human_bytes
from ds_exp.config.schema import Config, as_dict, plain
from ds_exp.config.secrets import redact, redact_text
from ds_exp.core.errors import RunFailed, first_line
from ds_exp.core.files import append_whole, disk_free_bytes, json_text, no_room, same_disk, write_text_atomic
from ds_exp.core.status import RESUMABLE_ENDS, RunStatus
from ds_exp.core.waits import announced
from ds_exp.resume.store import TrainState

log = logging.getLogger(__name__)

__all__ = ["MetricsLog", "TensorBoardRun", "Trackers", "WandbRun", "drop_lines_after"]
FULL = 4096  # bytes free under which a disk counts as full (less than a page: nothing more can be written)


class MetricsLog:
    """One JSON object per line in <run dir>/metrics.jsonl (rank 0 writes; other ranks hold a disabled log). A line
    that cannot be written (a full disk) stops the run with one message, and leaves no line cut short behind."""

    def __init__(self, path: Path, enabled: bool, start_step: int = 0) -> None:
        self.path = path
        self.enabled = enabled
        if enabled and start_step:
            drop_lines_after(path, start_step)
        self._file = io.FileIO(path, "a") if enabled else None  # unbuffered: each line is on disk once written

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            append_whole(self._file, (json_text(record) + "\n").encode(), self.path)
        except OSError as err:
            file, self._file = self._file, None
            file.close()
            raise RunFailed(write_failure_message(self.path, err, record.get("step"))) from err

    def close(self, status: RunStatus | None = None, summary: dict[str, Any] | None = None) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()


def write_failure_message(path: Path, err: OSError | BaseException, step: object) -> str:
    """A file of the run could not be written at `step`: the run stops here, and what to do."""
    reason = no_room(err) or (os.strerror(err.errno) if isinstance(err, OSError) and err.errno else first_line(err))
    free = human_bytes(disk_free_bytes(path))
    return (
        f"could not write {path} ({reason}; {free} free on its disk), so the run stopped at step {step}; its complete "
        "checkpoints are as they were. Free some space, then continue with the same overrides plus resume=auto"
    )


def drop_lines_after(path: Path, step: int) -> Path | None:
    """A run resumed from the checkpoint at `step`: the lines an earlier attempt wrote past it (it was killed after
    that checkpoint) leave `path`, so that it holds one line per step of the course the run followed. They are
    kept, not lost: moved to attempts/<time>/<name> beside it (returned)."""
    if not path.is_file():
        return None
    keep: list[str] = []
    past: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            after = int(json.loads(line).get("step", 0)) > step
        except (ValueError, TypeError, AttributeError):
            after = False  # not a metric line of ours (a cut-short last line): kept as it is
        (past if after else keep).append(line)
    if not past:
        return None
    aside = path.parent / "attempts" / time.strftime("%Y-%m-%d_%H-%M-%S") / f"{path.stem}.after_step{step}.jsonl"
    aside.parent.mkdir(parents=True, exist_ok=True)
    aside.write_text("".join(past), encoding="utf-8")
    write_text_atomic(path, "".join(keep))
    log.info("resume from step %d: %d line(s) of %s past it moved to %s", step, len(past), path.name, aside)
    return aside


class WandbRun:
    """A wandb run on rank 0 when logger.wandb.mode is not disabled; a no-op everywhere else."""

    name = "wandb"
    finish_bound = "it waits until the data is uploaded; Ctrl-C leaves the rest to `wandb sync` (the run's wandb/)"

    def __init__(self, cfg: Config, run_dir: Path, *, enabled: bool, run_id: str | None, start_step: int = 0) -> None:
        self.run = None
        self.run_id = run_id
        self.online, self.server = False, ""
        self.store: Path | None = None  # where its files go, on this machine
        wandb_cfg = cfg.logger.wandb
        mode = plain(wandb_cfg.mode)
        if not enabled or mode == "disabled":
            return
        import wandb

        tags = [
            f"zero{cfg.zero.stage}",
            str(plain(cfg.precision.dtype)),
            cfg.model.name,
        ]
        # from the checkpoint's step: wandb's rewind sets aside what a killed attempt logged past it, as
        # metrics.jsonl does (wandb >= 0.17.1; its "resume" would keep those steps and drop the resumed ones)
        resuming: dict[str, Any] = (
            {"resume_from": f"{run_id}?_step={start_step}"} if run_id and start_step else {"resume": "allow"}
        )
        # online: a server (checked before the run built anything, ds_exp.config.logger_checks); said while it waits
        self.online = mode == "online"
        self.server = without_passwords(os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL)
        bound = "wandb gives up after its init_timeout, 90 s unless set"
        waiting = announced(f"wandb's server {self.server}", bound=bound) if self.online else contextlib.nullcontext()
        with waiting:
            self.run = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                group=wandb_cfg.group or cfg.experiment_name,
                name=wandb_cfg.name or run_dir.name,
                tags=[*tags, *map(redact_text, wandb_cfg.tags)],  # a tag may hold a secret by its shape
                dir=str(wandb_cfg.dir or run_dir),
                mode=mode,
                id=run_id,  # set when resuming: the same wandb run continues
                **resuming,
                config=redact(as_dict(cfg)),
                # logger.wandb.api_key goes to wandb's settings, not its config (else wandb reads WANDB_API_KEY or
                # ~/.netrc); an offline run writes it nowhere (tests/integration/test_security.py). silent: wandb's
                # own lines (its banner, and 34 lines of run history after ds_exp's last line) stay off the
                # console; the line below says where the run is
                settings=wandb.Settings(silent=True, api_key=wandb_cfg.api_key or None),
            )
        self.run_id = self.run.id
        self.store = Path(self.run.dir).parent  # <dir>/wandb/<run>/ (its files/ and the .wandb record)
        if self.online:
            log.info("wandb: run %s", self.run.url or self.run.id)
        else:
            log.info("wandb: an offline run; upload it with: wandb sync %s", shown_path(self.store))

    @property
    def location(self) -> str:
        return str(self.store)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)
            self._check_room()

    def _check_room(self) -> None:
        """wandb's service process writes the run's files and loses what a full disk refuses without a word: the
        disk is looked at instead (a statvfs per metric line)."""
        if self.store is not None and disk_free_bytes(self.store) < FULL:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.store))

    def table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        """Rows of equal keys as a wandb Table (e.g. the generations of one evaluation)."""
        if self.run is not None and rows:
            import wandb

            columns = list(rows[0])
            header: list[str | int] = [*columns]
            self.run.log({key: wandb.Table(columns=header, data=[[r[c] for c in columns] for r in rows])}, step=step)

    def close(self, status: RunStatus, summary: dict[str, Any] | None = None) -> None:
        """Record how the run ended and finish the wandb run (a failed exit code unless it can be resumed)."""
        if self.run is not None:
            run, self.run = self.run, None
            run.summary["status"] = status
            # online: wandb uploads what is left and waits for its server (as long as it takes, unless
            # finish_timeout is set): said while it does
            waiting = (
                announced(f"wandb's server to take the run's last data ({self.server})", bound=self.finish_bound)
                if self.online
                else contextlib.nullcontext()
            )
            with waiting:
                run.finish(exit_code=0 if status in RESUMABLE_ENDS else 1)

    def abandon(self) -> None:
        """Stop logging (its disk is full); wandb's service ends the run when the process does."""
        run, self.run = self.run, None
        if run is not None:
            with contextlib.suppress(Exception):
                run.finish(exit_code=1)


class Trackers:
    """Every tracker of the run behind one interface: what the metric lines, evaluations and checkpoints use."""

    def __init__(self, cfg: Config, run_dir: Path, *, enabled: bool, start: TrainState) -> None:
        step = int(getattr(start, "step", 0) or 0)
        self.run_dir = run_dir
        self.all: list[MlflowRun | TensorBoardRun | WandbRun] = []
        try:  # the one most likely to refuse (a tracking store) first; any refusal closes those already open
            self.mlflow = MlflowRun(
                cfg, run_dir, enabled=enabled, run_id=getattr(start, "mlflow_run_id", None), start_step=step
            )
            self.all.append(self.mlflow)
            self.tensorboard = TensorBoardRun(cfg, run_dir, enabled=enabled, start_step=step)
            self.all.append(self.tensorboard)
            self.wandb = WandbRun(
                cfg, run_dir, enabled=enabled, run_id=getattr(start, "wandb_run_id", None), start_step=step
            )
            self.all.append(self.wandb)
        except BaseException:
            self.close(RunStatus.FAILED)
            raise

    @property
    def run_id(self) -> str | None:
        """The wandb run's id (what checkpoints have always recorded as wandb_run_id)."""
        return self.wandb.run_id

    def ids(self) -> dict[str, str | None]:
        """What a checkpoint's marker keeps so that a resume continues the same tracker runs."""
        return {"wandb_run_id": self.wandb.run_id, "mlflow_run_id": self.mlflow.run_id}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for tracker in list(self.all):
            self._guarded(tracker, step, functools.partial(tracker.log, metrics, step))

    def table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        for tracker in list(self.all):
            self._guarded(tracker, step, functools.partial(tracker.table, key, rows, step))

    def _guarded(self, tracker: MlflowRun | TensorBoardRun | WandbRun, step: int, call: Callable[[], None]) -> None:
        """A tracker whose store fails mid-run (a server gone, its own disk full) costs its records from here, never
        the training: said once, and it is not written to again. A full disk under the run directory stops the run
        with one message: metrics.jsonl and the next checkpoint would fail on it too."""
        try:
            call()
        except Exception as err:
            self.all.remove(tracker)
            with contextlib.suppress(Exception):
                tracker.abandon()
            store = tracker.store
            if no_room(err) and store is not None and same_disk(store, self.run_dir):
                raise RunFailed(write_failure_message(store, err, step)) from err
            log.warning(
                "%s: could not write to %s (%s): its records stop at step %d; the run goes on (metrics.jsonl has "
                "every line)",
                tracker.name,
                tracker.location,
                redact_text(no_room(err) or first_line(err)),
                step,
            )

    def close(self, status: RunStatus, summary: dict[str, Any] | None = None) -> None:
        """Each tracker ends however the others fare: one failing to close never hides the run's own outcome. On a
        full disk under the run directory a failed run has said so already: the trackers' part goes to the log."""
        for tracker in self.all:
            try:
                tracker.close(status, summary)
            except Exception as err:
                store = tracker.store
                said = status == RunStatus.FAILED and store is not None and same_disk(store, self.run_dir)
                (log.debug if said and no_room(err) else log.warning)(
                    "%s: could not end its run in %s (%s)",
                    tracker.name,
                    tracker.location,
                    redact_text(no_room(err) or first_line(err)),
                )
        self.all = []
