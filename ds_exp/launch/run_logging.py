"""ds_exp's loggers, and what libraries say before a rank's log file exists.

Libraries talk before the log file exists (DeepSpeed logs "Setting accelerator to CPU" on import, on every rank):
`hold_library_logs` (first thing in the CLI) holds those records, and ds_exp.runtime.rank_logging replays them
into the rank's log file once it exists.
"""

from __future__ import annotations

import logging

STEP_LOGGER = "ds_exp.steps"
FILE_LOGGER = "ds_exp.file"  # the log file only, never the console (e.g. the traceback behind a user error)
LIBRARY_LOGGER = "ds_exp.library"  # what libraries printed on stdout (captured): the log file only
LOGGERS = ("ds_exp", STEP_LOGGER, FILE_LOGGER, LIBRARY_LOGGER, "DeepSpeed", "py.warnings")

# The file-only loggers never reach the console, not even before the log file exists (Python's last-resort
# handler would print their tracebacks to stderr): until setup_run_logging adds the file, they drop records.
for _name in (FILE_LOGGER, LIBRARY_LOGGER):
    logging.getLogger(_name).addHandler(logging.NullHandler())
    logging.getLogger(_name).propagate = False


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


def hold_library_logs() -> None:
    """Before anything imports DeepSpeed: hold its records (and Python warnings, and captured library output) for
    the log file, and silence the compiler probes DeepSpeed runs at import (setuptools' logger)."""
    logging.captureWarnings(True)
    # FILE_LOGGER too: what a rank other than 0 says while it waits before its log file exists (ds_exp.core.waits)
    for name in ("DeepSpeed", "py.warnings", LIBRARY_LOGGER, FILE_LOGGER):
        logger = logging.getLogger(name)
        if HELD not in logger.filters:
            logger.addFilter(HELD)
    logging.getLogger("compilers").setLevel(logging.WARNING)  # "gcc ... test.c" from DeepSpeed's op checks
