"""Errors meant for people: one message naming the key (or file) and the fix, no traceback by default."""

from __future__ import annotations

from ds_exp.core.status import RunStatus


class DsExpError(Exception):
    """Base of every error ds_exp reports to the user as a message instead of a traceback."""

    exit_code = 2


class ConfigError(DsExpError):
    """A bad config value or combination. Holds one or more lines, each naming a key and its fix."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class DataError(DsExpError):
    """A missing file, a malformed row or a dataset that cannot feed training."""


class Refused(DsExpError):
    """Refused before anything was written: the run directory stays exactly as it was (no summary is written)."""


class ResumeError(Refused):
    """`resume=` points at something that holds no usable checkpoint, or one this run cannot continue."""


class RunFailed(DsExpError):
    """Training stopped for a reason the user must act on (non-finite losses, a dead rank, ...)."""

    exit_code = 1


class Diverged(RunFailed):
    """The losses, evaluation or weights stopped being finite: the settings are at fault, not the set-up."""

    exit_code = 3
    status = RunStatus.DIVERGED


def first_line(err: BaseException, limit: int = 300) -> str:
    """An exception's first non-empty line (at most `limit` characters), or its class name when it says nothing."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:limit] if lines else type(err).__name__
