"""Errors meant for people: one message naming the key (or file) and the fix, no traceback by default."""

from __future__ import annotations

import os
import sys


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


class ResumeError(DsExpError):
    """`resume=` points at something that holds no usable checkpoint."""


class RunFailed(DsExpError):
    """Training stopped for a reason the user must act on (non-finite losses, a dead rank, ...)."""

    exit_code = 1


def report_user_error(err: DsExpError, traceback_hint: bool = True) -> None:
    """The message on stderr: its first line after "ds_exp: error:", the rest indented; no traceback, and no
    registered secret (ds_exp.secrets)."""
    from ds_exp.secrets import redact_text

    lines = redact_text(str(err)).splitlines() or [type(err).__name__]
    print(f"ds_exp: error: {lines[0]}", file=sys.stderr)
    for line in lines[1:]:
        print(f"  {line}", file=sys.stderr)
    if traceback_hint and os.environ.get("HYDRA_FULL_ERROR") != "1":
        print("  (set HYDRA_FULL_ERROR=1 for the full traceback)", file=sys.stderr)
