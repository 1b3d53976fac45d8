"""Per-rank log files, and a quiet console on every rank but 0."""

from __future__ import annotations

import logging
from pathlib import Path

STEP_LOGGER = "ds_exp.steps"
FILE_LOGGER = "ds_exp.file"  # the log file only, never the console (e.g. the traceback behind a user error)
_LOGGERS = ("ds_exp", STEP_LOGGER, FILE_LOGGER, "DeepSpeed")
_FORMAT = "%(asctime)s [rank%(rank)s] %(levelname)s %(name)s: %(message)s"

# The file-only logger never reaches the console, not even before the log file exists (Python's last-resort
# handler would print its tracebacks to stderr): until setup_run_logging adds the file, it drops records.
logging.getLogger(FILE_LOGGER).addHandler(logging.NullHandler())
logging.getLogger(FILE_LOGGER).propagate = False


class _RankFilter(logging.Filter):
    """Stamps the rank, and blanks registered secrets (ds_exp.secrets.register_secrets) in the message."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        from ds_exp.secrets import redact_text

        record.rank = self.rank
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def setup_run_logging(run_dir: Path, rank: int) -> Path:
    """Every rank logs to <run dir>/logs/rank<N>.log; only rank 0 keeps INFO on the console."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank{rank}.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(_RankFilter(rank))
    handler.setLevel(logging.INFO)
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    logging.getLogger(STEP_LOGGER).propagate = False  # step lines: in the file; the console has the progress bar
    logging.getLogger(FILE_LOGGER).propagate = False
    # DeepSpeed prints a lot on every rank: keep its console output to warnings (the full text is in the file).
    for h in logging.getLogger("DeepSpeed").handlers:
        if h is not handler:
            h.setLevel(logging.WARNING)
    if rank != 0:
        root = logging.getLogger()
        for h in root.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                h.setLevel(logging.WARNING)
        if not root.handlers:
            logging.getLogger("ds_exp").propagate = False
    return path


def close_run_logging() -> None:
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if isinstance(h, logging.FileHandler) and "/logs/rank" in h.baseFilename:
                logger.removeHandler(h)
                h.close()
