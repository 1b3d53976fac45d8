"""Per-rank log files (logs/rank<N>.log: everything libraries log or print) and a readable console: rank 0 speaks, each
warning once, other ranks only errors; a console line never shares one with a progress bar."""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import datasets
import transformers
from tqdm import tqdm

from ds_exp.config.secrets import redact_text
from ds_exp.core.files import no_room
from ds_exp.launch.run_logging import FILE_LOGGER, HELD, LIBRARY_LOGGER, LOGGERS, STEP_LOGGER, on_terminal

_FORMAT = "%(asctime)s [rank%(rank)s] %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    """Stamps the rank, and blanks registered secrets (ds_exp.config.secrets.register_secrets) in the message."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


class _Once(logging.Filter):
    """Each record once: console warnings by first line; Python's warnings every record (torch warns at every step)."""

    def __init__(self, level: int = logging.WARNING, first_line: bool = True) -> None:
        super().__init__()
        self.level, self.first_line = level, first_line
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level:
            return True
        message = record.getMessage()
        key = message.strip().splitlines()[0] if self.first_line and message.strip() else message
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


_WARNINGS_ONCE = _Once(logging.NOTSET, first_line=False)

_LIBRARY_SETTINGS: list[tuple[bool, bool, int]] = []  # as the run found them (setup_run_logging)
# Loggers that do not propagate to the root logger: the log file is attached to each of them.
_OWN_FILE = (STEP_LOGGER, FILE_LOGGER, LIBRARY_LOGGER, "py.warnings", "DeepSpeed", "transformers")


class _OursOnly(logging.Filter):
    """On the root logger's console handler: ds_exp's and Hydra's records, and anyone's errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name.split(".")[0] in ("ds_exp", "hydra", "__main__")
        return ours or record.levelno >= logging.ERROR


class LogFile(logging.FileHandler):
    """A log file a full disk stops quietly (not a traceback per line); the run's own message names the full disk."""

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if err is None or no_room(err) is None:
            super().handleError(record)
            return
        self.setLevel(logging.CRITICAL + 1)  # nothing more is written
        stream, self.stream = self.stream, None
        if stream is not None:
            with contextlib.suppress(OSError):  # its buffer cannot be flushed: the descriptor closes all the same
                stream.close()


class _BarSafeStream:
    """A console stream that clears ds_exp's progress bars before a line and redraws them after (tqdm.write's way)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        with tqdm.external_write_mode(file=self.stream):
            self.stream.write(text)
            self.stream.flush()

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


def setup_run_logging(run_dir: Path, rank: int) -> Path:
    """Every rank logs to <run dir>/logs/rank<N>.log; rank 0 keeps ds_exp's INFO on the console, others errors."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank{rank}.log"
    handler = LogFile(path)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(_RankFilter(rank))
    handler.setLevel(logging.INFO)
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    for name in _OWN_FILE:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False  # the console gets these only through the handlers below
    root = logging.getLogger()
    for other in root.handlers:
        if type(other) is logging.FileHandler:  # Hydra's job log (<run dir>/<job name>.log) behaves as LogFile
            other.__class__ = LogFile
    root.addHandler(handler)  # ds_exp's records, and those of every library that propagates (torch, datasets, ...)
    for record in HELD.records:  # what libraries said before the file existed
        handler.handle(record)
    HELD.records.clear()
    HELD.active = False
    once = _Once()
    if _WARNINGS_ONCE not in logging.getLogger("py.warnings").filters:
        logging.getLogger("py.warnings").addFilter(_WARNINGS_ONCE)
    # DeepSpeed, transformers and datasets print on every rank through their own handlers: errors only
    for name in ("DeepSpeed", "transformers", "datasets"):
        for h in logging.getLogger(name).handlers:
            if h is not handler:
                _console(h, logging.ERROR, once)
    console_level = logging.INFO if rank == 0 else logging.ERROR
    for h in root.handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            _console(h, console_level, once)
            if not any(isinstance(f, _OursOnly) for f in h.filters):
                h.addFilter(_OursOnly())
            if not isinstance(h.stream, _BarSafeStream):
                h.setStream(_BarSafeStream(h.stream))
    # libraries' own progress bars (loading weights, writing shards) never: ds_exp says what it is doing instead;
    # put back as they were when the run ends (the Python API: a notebook's bars and verbosity are its own)
    hf_logging = transformers.utils.logging
    if not _LIBRARY_SETTINGS:
        _LIBRARY_SETTINGS.append(
            (hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled(), hf_logging.get_verbosity())
        )
    hf_logging.disable_progress_bar()
    if rank != 0 or not on_terminal():
        # tokenizing: rank 0's bar, on a terminal only (piped, ds_exp.data.encode says it in plain lines)
        datasets.disable_progress_bars()
    if rank != 0:
        transformers.utils.logging.set_verbosity_error()
    return path


def _console(handler: logging.Handler, level: int, once: _Once) -> None:
    handler.setLevel(level)
    handler.filters = [f for f in handler.filters if not isinstance(f, _Once)]  # one per run, not one per job
    handler.addFilter(once)


def close_run_logging() -> None:
    hf_logging = transformers.utils.logging
    for hf_bars, data_bars, verbosity in _LIBRARY_SETTINGS:
        (hf_logging.enable_progress_bar if hf_bars else hf_logging.disable_progress_bar)()
        (datasets.enable_progress_bars if data_bars else datasets.disable_progress_bars)()
        hf_logging.set_verbosity(verbosity)
    _LIBRARY_SETTINGS.clear()
    for logger in [logging.getLogger(name) for name in (*LOGGERS, *_OWN_FILE)] + [logging.getLogger()]:
        for h in list(logger.handlers):
            if isinstance(h, logging.FileHandler) and "/logs/rank" in h.baseFilename:
                logger.removeHandler(h)
                h.close()


@contextlib.contextmanager
def library_stdout(stderr: bool = False) -> Iterator[None]:
    """What libraries print (Python or C) inside the block goes to the log file; with `stderr`, that too."""
    printed: list[str] = []
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_captured(1, "stdout", printed))
            if stderr:
                stack.enter_context(_captured(2, "stderr", printed))
            yield
    finally:
        library = logging.getLogger(LIBRARY_LOGGER)
        for line in "".join(printed).splitlines():
            if line.strip():
                library.info(line)


@contextlib.contextmanager
def _captured(fd: int, name: str, printed: list[str]) -> Iterator[None]:
    """File descriptor `fd` and sys.<name> into `printed` for the block."""
    console = getattr(sys, name)  # a library's handler may hold it: what it writes inside the block is captured too
    console.flush()
    _flush_c_stdio()
    python = io.StringIO()
    with tempfile.TemporaryFile() as sink, contextlib.ExitStack() as restore:
        with contextlib.suppress(OSError):  # no such file descriptor (a daemon): Python's prints are still caught
            saved = os.dup(fd)
            restore.callback(os.close, saved)
            os.dup2(sink.fileno(), fd)
            restore.callback(os.dup2, saved, fd)
        redirect = contextlib.redirect_stdout if name == "stdout" else contextlib.redirect_stderr
        try:
            with redirect(python):
                yield
        finally:
            console.flush()
            _flush_c_stdio()
            restore.close()  # the file descriptor back to the console
            sink.seek(0)
            printed.append(python.getvalue() + sink.read().decode(errors="replace"))


def _flush_c_stdio() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)
