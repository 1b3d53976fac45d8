"""ds_exp's console lines (`ds_exp: <message>`: time, level and module stay in the log files), and what libraries say
before a rank's log file exists (held by `hold_library_logs`, replayed there by ds_exp.runtime.rank_logging)."""

from __future__ import annotations

import logging
import sys

STEP_LOGGER = "ds_exp.steps"
FILE_LOGGER = "ds_exp.file"  # the log file only, never the console (e.g. the traceback behind a user error)
LIBRARY_LOGGER = "ds_exp.library"  # what libraries printed on stdout (captured): the log file only
LOGGERS = ("ds_exp", STEP_LOGGER, FILE_LOGGER, LIBRARY_LOGGER, "DeepSpeed", "py.warnings")

# file-only loggers drop records until setup_run_logging adds the file (else Python's last resort prints them)
for _name in (FILE_LOGGER, LIBRARY_LOGGER):
    logging.getLogger(_name).addHandler(logging.NullHandler())
    logging.getLogger(_name).propagate = False


class ConsoleFormatter(logging.Formatter):
    """`ds_exp: <message>`, `warning: `/`error: ` from those levels, a library's record naming the library."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).lstrip()
        if text.startswith("ds_exp: "):  # a message that says whose it is already
            return text
        if record.levelno >= logging.ERROR:
            level = "error: "
        elif record.levelno >= logging.WARNING:
            level = "warning: "
        else:
            level = ""
        ours = record.name.split(".")[0] in ("ds_exp", "hydra", "__main__")
        return f"ds_exp: {level}{'' if ours else f'{record.name}: '}{text}"


def on_terminal() -> bool:
    """Whether the console (stderr, where progress bars are drawn) is a terminal: bars are for terminals only."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without one, or closed
        return False


class _Held(logging.Filter):
    """Holds the records of a logger until the log file exists."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.active = True

    def filter(self, record: logging.LogRecord) -> bool:
        if self.active:
            self.records.append(record)
            return False
        return True


HELD = _Held()


def quiet_matplotlib() -> None:
    """matplotlib's INFO lines on first use ("generated new fontManager") stay off the console, a sweep's included."""
    mpl_log = logging.getLogger("matplotlib")
    if mpl_log.getEffectiveLevel() < logging.WARNING:
        mpl_log.setLevel(logging.WARNING)


def hold_library_logs() -> None:
    """Before DeepSpeed is imported: hold its records and output for the log file, and silence its compiler probes."""
    logging.captureWarnings(True)
    # FILE_LOGGER too: what a rank other than 0 says while it waits before its log file exists (ds_exp.core.waits)
    for name in ("DeepSpeed", "py.warnings", LIBRARY_LOGGER, FILE_LOGGER):
        logger = logging.getLogger(name)
        if HELD not in logger.filters:
            logger.addFilter(HELD)
    logging.getLogger("compilers").setLevel(logging.WARNING)  # "gcc ... test.c" from DeepSpeed's op checks
