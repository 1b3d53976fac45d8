"""TensorBoard event files on rank 0; a resume purges what a killed attempt wrote past its step. Written in the caller's
thread: SummaryWriter's own thread dies at the first write error and blocks forever."""

from __future__ import annotations

import io
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.record_writer import masked_crc32c
from tensorboardX.summary import scalar, text

from ds_exp.artifacts.trackers.base import TrackedRun, Tracker
from ds_exp.config.secrets import redact
from ds_exp.config.trackers import TensorBoardConfig
from ds_exp.core.files import append_whole, json_text
from ds_exp.core.status import RunStatus

FLUSH_SECONDS = 120.0  # how often the file is synced to the disk (tensorboardX's default)


class EventFile:
    """One TensorBoard event file (TFRecord framing: length, its masked CRC32C, the Event, its masked CRC32C)."""

    def __init__(self, directory: Path, suffix: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        # tensorboardX's name: TensorBoard reads a directory's files in the order of their names
        self.path = directory / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}{suffix}"
        self.file: io.FileIO | None = io.FileIO(self.path, "a")  # unbuffered: what a write takes is on disk
        self.synced = time.monotonic()
        self.add(Event(file_version="brain.Event:2"))

    def scalar(self, key: str, value: float, step: int) -> None:
        self.add(Event(summary=scalar(key, value)), step)

    def text(self, key: str, value: str, step: int) -> None:
        self.add(Event(summary=text(key, value)), step)

    def add(self, event: Event, step: int | None = None) -> None:
        """Append one record; a write that fails leaves the file as it was (no record cut short) and is raised."""
        if self.file is None:
            return
        event.wall_time = time.time()
        if step is not None:
            event.step = int(step)
        data = event.SerializeToString()
        header = struct.pack("Q", len(data))
        record = header + struct.pack("I", masked_crc32c(header)) + data + struct.pack("I", masked_crc32c(data))
        try:
            append_whole(self.file, record, self.path)  # no record cut short stays behind
        except OSError:
            self.abandon()
            raise
        if time.monotonic() - self.synced > FLUSH_SECONDS:
            os.fsync(self.file.fileno())
            self.synced = time.monotonic()

    def close(self) -> None:
        if self.file is not None:
            try:
                os.fsync(self.file.fileno())
            finally:
                self.abandon()

    def abandon(self) -> None:
        """Close the file without another write (unbuffered: nothing is pending)."""
        file, self.file = self.file, None
        if file is not None:
            file.close()


class TensorBoardRun(Tracker):
    """Event files on rank 0 (see the module docstring)."""

    name = "TensorBoard"

    def __init__(self, settings: TensorBoardConfig, run: TrackedRun, *, run_id: str | None, start_step: int) -> None:
        self.last_step = start_step
        self.dir = self.store = Path(settings.dir).expanduser() if settings.dir else run.run_dir / "tensorboard"
        # a file per attempt: the suffix keeps two attempts within one second apart and in order

        self.events: EventFile | None = EventFile(self.dir, f".step{start_step:09d}.{os.getpid()}")
        if start_step:
            # TensorBoard hides the steps from here on that earlier files hold (SummaryWriter's purge_step)
            self.events.add(Event(session_log=SessionLog(status=SessionLog.START)), start_step + 1)
        else:
            self.events.text("config", f"```\n{json_text(redact(run.params), indent=2)}\n```", 0)

    @property
    def writer(self) -> EventFile | None:
        return self.events

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.events is None:
            return
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.events.scalar(key, float(value), step)
        self.last_step = max(self.last_step, step)

    def table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        """Rows (the generations of one evaluation) as a Markdown table in TensorBoard's text tab."""
        if self.events is None or not rows:
            return
        columns = list(rows[0])
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
        self.events.text(key, "\n".join(lines), step)

    def artifact(self, name: str, document: dict[str, Any]) -> None:
        """The document as text under its name's stem (summary.json: "summary"), at the last step logged."""
        if self.events is not None:
            self.events.text(Path(name).stem, f"```\n{json_text(redact(document), indent=2)}\n```", self.last_step)

    def close(self, status: RunStatus) -> None:
        events, self.events = self.events, None
        if events is not None:
            events.close()

    def abandon(self) -> None:
        """Stop writing at once, without a last record (its disk is full)."""
        events, self.events = self.events, None
        if events is not None:
            events.abandon()
