"""Where metric lines go on rank 0: metrics.jsonl and the trackers, each imported only when on, behind `Trackers`."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds_exp.artifacts.trackers.base import TrackedRun, Tracker
from ds_exp.config.memory_plan import human_bytes
from ds_exp.config.secrets import redact_text
from ds_exp.config.trackers import LoggerConfig, active_trackers
from ds_exp.core.errors import RunFailed, first_line
from ds_exp.core.files import append_whole, disk_free_bytes, json_text, no_room, same_disk, write_text_atomic
from ds_exp.core.status import RunStatus
from ds_exp.resume.store import TrainState

log = logging.getLogger(__name__)

__all__ = ["MetricsLog", "Trackers", "drop_lines_after"]


class MetricsLog:
    """<run dir>/metrics.jsonl (rank 0); a line that cannot be written stops the run, none cut short."""

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
    """A resume from `step`: lines a killed attempt wrote past it move to attempts/<time>/<name> beside (returned)."""
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


class Trackers:
    """Every tracker of the run behind one interface; rank 0 builds those its settings turn on, the others none."""

    def __init__(self, logger: LoggerConfig, run: TrackedRun, *, enabled: bool, start: TrainState) -> None:
        self.run_dir = run.run_dir
        self.continued = dict(start.trackers)  # kept for a resume even by an attempt that turned a tracker off
        self.built: dict[str, Tracker] = {}  # by the key of its run id in a marker (the trackers that have one)
        self.all: list[Tracker] = []  # those still written to
        if not enabled:
            return
        try:  # any refusal closes those already open
            for entry in active_trackers(logger):
                build = entry.load_builder()
                key = entry.run_id_key
                run_id = self.continued.get(key) if key else None
                tracker = build(entry.settings_of(logger), run, run_id=run_id, start_step=start.step)
                self.all.append(tracker)
                if key:
                    self.built[key] = tracker
        except BaseException:
            self.close(RunStatus.FAILED)
            raise

    def ids(self) -> dict[str, str]:
        """What a checkpoint's marker keeps ("trackers") so that a resume continues the same tracker runs."""
        ids = {**self.continued, **{key: t.run_id for key, t in self.built.items() if t.run_id}}
        return {key: ids[key] for key in sorted(ids)}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for tracker in list(self.all):
            self._guarded(tracker, step, functools.partial(tracker.log, metrics, step))

    def table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        for tracker in list(self.all):
            self._guarded(tracker, step, functools.partial(tracker.table, key, rows, step))

    def _guarded(self, tracker: Tracker, step: int, call: Callable[[], None]) -> None:
        """A failing tracker store costs its records, said once, never the training; a full disk stops the run."""
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
        """Each tracker gets summary.json and ends, however the others fare: none hides the run's outcome."""
        for tracker in self.all:
            calls = [functools.partial(tracker.artifact, "summary.json", summary)] if summary is not None else []
            failed: list[Exception] = []
            for call in [*calls, functools.partial(tracker.close, status)]:
                try:
                    call()
                except Exception as err:
                    failed.append(err)
            if failed:
                store, first = tracker.store, failed[0]
                said = status == RunStatus.FAILED and store is not None and same_disk(store, self.run_dir)
                (log.debug if said and no_room(first) else log.warning)(
                    "%s: could not end its run in %s (%s)",
                    tracker.name,
                    tracker.location,
                    redact_text(no_room(first) or first_line(first)),
                )
        self.all = []
