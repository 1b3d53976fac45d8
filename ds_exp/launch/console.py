"""What a person reads when a run cannot go on: one message, its first line after "ds_exp: error:", no traceback."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

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


def exit_on_error(check: Callable[[], None], what: str, after: str = "nothing was started") -> None:
    """Run a check that guards files (a Hydra callback's): whatever it raises stops the process. Hydra 1.3 turns
    an exception raised in a callback into a warning and goes on (`Callbacks._notify`), which would disable the
    check; so a user error is its one message (exit 2), anything else one line naming `what` failed (exit 1, the
    traceback under HYDRA_FULL_ERROR=1), and the run never goes ahead."""
    try:
        check()
    except DsExpError as err:
        report_user_error(err)
        raise SystemExit(err.exit_code) from None
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            traceback.print_exc()
        first = (str(err).strip().splitlines() or [""])[0]
        print(
            f"ds_exp: error: {what} failed ({type(err).__name__}{': ' + redact_text(first) if first else ''}); {after}",
            file=sys.stderr,
        )
        if os.environ.get("HYDRA_FULL_ERROR") != "1":
            print("  (set HYDRA_FULL_ERROR=1 for the full traceback)", file=sys.stderr)
        raise SystemExit(1) from None
