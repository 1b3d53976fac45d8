"""Per-rank log files and a console people can read: rank 0 speaks, other ranks only on error, library chatter
goes to the log files, and each warning reaches the console at most once."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import datasets
import transformers

from ds_exp.config.secrets import redact_text
from ds_exp.launch.run_logging import FILE_LOGGER, HELD, LIBRARY_LOGGER, LOGGERS, STEP_LOGGER

_FORMAT = "%(asctime)s [rank%(rank)s] %(levelname)s %(name)s: %(message)s"


# Warnings from inside libraries that a user can do nothing about: the log file only, never the console.
_CHATTER = (
    "torch.distributed.all_gather_into_tensor` is deprecated",
    "torch.distributed.reduce_scatter_tensor` is deprecated",
    "is_gradient_checkpointing` is deprecated",
)


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
    """The console sees each warning once; library-internal deprecations never (they stay in the file)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        if any(chatter in message for chatter in _CHATTER):
            return False
        key = message.strip().splitlines()[0] if message.strip() else message
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class _FirstOnly(logging.Filter):
    """A warning raised at every step (torch's deprecations inside DeepSpeed) is recorded once, file included."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


_WARNINGS_ONCE = _FirstOnly()


def setup_run_logging(run_dir: Path, rank: int) -> Path:
    """Every rank logs to <run dir>/logs/rank<N>.log; rank 0 keeps INFO on the console, the others only errors."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank{rank}.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(_RankFilter(rank))
    handler.setLevel(logging.INFO)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    for name in (STEP_LOGGER, FILE_LOGGER, LIBRARY_LOGGER, "py.warnings"):
        logging.getLogger(name).propagate = False  # the console gets these only through the handlers below
    for record in HELD.records:  # what libraries said before the file existed
        handler.handle(record)
    HELD.records.clear()
    HELD.active = False
    once = _Once()
    console_level = logging.INFO if rank == 0 else logging.ERROR
    warnings_console = logging.StreamHandler(sys.stderr)
    warnings_console.setLevel(logging.WARNING if rank == 0 else logging.ERROR)
    warnings_console.addFilter(once)
    warnings_console.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("py.warnings").addHandler(warnings_console)
    if _WARNINGS_ONCE not in logging.getLogger("py.warnings").filters:
        logging.getLogger("py.warnings").addFilter(_WARNINGS_ONCE)
    # DeepSpeed and transformers print on every rank through their own handlers: warnings once on rank 0
    for name in ("DeepSpeed", "transformers"):
        for h in logging.getLogger(name).handlers:
            if h is not handler:
                _console(h, logging.WARNING if rank == 0 else logging.ERROR, once)
    root = logging.getLogger()
    for h in root.handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            _console(h, console_level, once)
    if rank != 0:
        _quiet_library_progress()
        if not root.handlers:
            logging.getLogger("ds_exp").propagate = False
    return path


def _console(handler: logging.Handler, level: int, once: _Once) -> None:
    handler.setLevel(level)
    handler.filters = [f for f in handler.filters if not isinstance(f, _Once)]  # one per run, not one per job
    handler.addFilter(once)


def _quiet_library_progress() -> None:
    """Ranks > 0 draw no progress bars (tokenizing, loading weights): rank 0's are the console's."""
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def close_run_logging() -> None:
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if isinstance(h, logging.FileHandler) and "/logs/rank" in h.baseFilename:
                logger.removeHandler(h)
                h.close()
    warnings_logger = logging.getLogger("py.warnings")
    for h in list(warnings_logger.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            warnings_logger.removeHandler(h)
