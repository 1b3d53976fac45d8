"""What a person reads when a run cannot go on: one message, its first line after "ds_exp: error:", no traceback."""

from __future__ import annotations

import os
import sys

from ds_exp.config.secrets import redact_text
from ds_exp.core.errors import DsExpError


def report_user_error(err: DsExpError, traceback_hint: bool = True) -> None:
    """The message on stderr: its first line after "ds_exp: error:", the rest indented; no traceback, and no
    registered secret (ds_exp.config.secrets)."""
    lines = redact_text(str(err)).splitlines() or [type(err).__name__]
    print(f"ds_exp: error: {lines[0]}", file=sys.stderr)
    for line in lines[1:]:
        print(f"  {line}", file=sys.stderr)
    if traceback_hint and os.environ.get("HYDRA_FULL_ERROR") != "1":
        print("  (set HYDRA_FULL_ERROR=1 for the full traceback)", file=sys.stderr)
