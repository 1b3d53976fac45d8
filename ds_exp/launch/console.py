"""Every command's error boundary (`@entry_point`): a DsExpError is its message and exit_code; anything else one line
naming its traceback's file, exit 1; Ctrl-C 130; a closed stdout 141. A launch's ranks print an error once."""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import re
import select
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Generic, ParamSpec, TypeVar

from hydra.errors import HydraException

from ds_exp.config.override_checks import composition_problem
from ds_exp.config.secrets import redact_text
from ds_exp.core.errors import ConfigError, DsExpError, first_line
from ds_exp.core.private_files import UnsafePath, open_private, private_dir, remove_own
from ds_exp.launch.environment import launched_with_several_ranks

P = ParamSpec("P")
T = TypeVar("T")

INTERRUPTED = 130  # 128 + SIGINT
STDOUT_CLOSED = 141  # 128 + SIGPIPE
_LOGGED_IN = "ds_exp_traceback_in"  # set on an exception whose traceback a log file holds already
_running = ["ds_exp"]  # the command this process runs: names its traceback files


class Command(Generic[P]):
    """A command's main inside the error boundary; with `exits`, a status other than 0 ends the process."""

    def __init__(self, name: str, work: Callable[P, int | None], exits: bool = False) -> None:
        self.name, self.work, self.exits = name, work, exits
        functools.update_wrapper(self, work)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> int:
        status = run_command(self.name, lambda: self.work(*args, **kwargs))
        if status and self.exits:
            raise SystemExit(status)
        return status


def entry_point(name: str, exits: bool = False) -> Callable[[Callable[P, int | None]], Command[P]]:
    """The error boundary on `def main(argv=None) -> int`; `name` says what failed and names its traceback's file."""

    def bound(work: Callable[P, int | None]) -> Command[P]:
        return Command(name, work, exits)

    return bound


def run_command(name: str, work: Callable[[], int | None]) -> int:
    """Run a command's work inside the error boundary; its exit status. SystemExit (argparse) goes through."""
    _running[0] = name
    try:
        try:
            status = work()
        except SystemExit:
            sys.stdout.flush()  # here, where a closed pipe is still ours to handle, not at interpreter exit
            raise
        sys.stdout.flush()
        return status or 0
    except KeyboardInterrupt:
        say(["ds_exp: interrupted"])  # Ctrl-C reaches every rank of a terminal's launch
        return INTERRUPTED
    except BrokenPipeError as err:
        if not stdout_closed():  # another pipe (a child process's): not the reader of our output going away
            return report_error(err)
        devnull = os.open(os.devnull, os.O_WRONLY)  # nothing buffered raises "Exception ignored ..." at exit
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
        return STDOUT_CLOSED
    except Exception as err:
        return report_error(err)


def report_error(err: Exception, log: Path | None = None, what: str | None = None, after: str = "") -> int:
    """`err` on stderr for a person; the exit status. Unexpected: one line naming its traceback's file."""
    if isinstance(err, (DsExpError, HydraException)):
        if full_error():
            sys.stderr.write(redact_text("".join(traceback.format_exception(err))))
        told = err if isinstance(err, DsExpError) else ConfigError(composition_problem(err))
        report_user_error(told)
        return told.exit_code
    report_unexpected(err, what or _running[0], log, after)
    return 1


def report_user_error(err: DsExpError) -> None:
    """The message on stderr, its first line after "ds_exp: error:", the rest indented; no traceback, no secret."""
    lines = redact_text(str(err)).splitlines() or [type(err).__name__]
    say([f"ds_exp: error: {lines[0]}", *(f"  {line}" for line in lines[1:])])


def say(lines: list[str]) -> None:
    """Print `lines` on stderr, unless another rank of this launch on this machine has printed them already."""
    if first_to_say("\n".join(lines)):
        print("\n".join(lines), file=sys.stderr, flush=True)


_SAID_KEEP_S = 24 * 3600  # how long a claim is kept (a launcher process id comes back only after many others)


def first_to_say(text: str) -> bool:
    """Whether this is the first of its launch's ranks on this machine to say `text` (when in doubt, it is)."""
    if not launched_with_several_ranks():
        return True
    launch = _launcher_process()
    if launch is None:
        return True
    root = Path(tempfile.gettempdir()) / f"ds_exp-{os.getuid()}"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    try:
        folder = private_dir(root / "said", root=root)
        remove_own(folder, _CLAIM, older_than_s=_SAID_KEEP_S)
        os.close(open_private(folder / f"{launch}-{digest}", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    except (OSError, UnsafePath):
        return True
    return True


_CLAIM = re.compile(r"\d+-\d+-[0-9a-f]{16}")  # <launcher's pid>-<its start time>-<digest>: what first_to_say makes


def _launcher_process() -> str | None:
    """The parent process's id and start time (clock ticks since boot: a reused id is another process)."""
    parent = os.getppid()
    try:
        stat = Path(f"/proc/{parent}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command's name, which may hold spaces
    return f"{parent}-{fields[19]}" if len(fields) > 19 else None


def report_unexpected(err: BaseException, what: str, log: Path | None = None, after: str = "") -> None:
    """One line: what failed, the exception's first line, and where its whole traceback is kept."""
    text = redact_text("".join(traceback.format_exception(err)))
    kept = keep_traceback(err, text, log)
    if full_error() or kept is None:  # asked for, or kept nowhere: shown rather than lost
        sys.stderr.write(text)
    detail = redact_text(first_line(err))
    said = type(err).__name__ if detail == type(err).__name__ else f"{type(err).__name__}: {detail}"
    where = f"; its traceback is in {kept}" if kept else ""
    print(f"ds_exp: error: {what} failed unexpectedly ({said}){after}{where}", file=sys.stderr)


def traceback_logged(err: BaseException, log_file: str | Path) -> None:
    """Say that `err`'s traceback is in `log_file` already (a rank's log): the boundary names it, not a copy."""
    setattr(err, _LOGGED_IN, str(log_file))


def keep_traceback(err: BaseException, text: str, log: Path | None) -> Path | None:
    """The file holding the traceback `text`: a log that has it, else `log`, else a new one in the cache; or None."""
    logged = getattr(err, _LOGGED_IN, None)
    if logged:
        return Path(logged)
    now = datetime.datetime.now()
    if log is not None:
        try:
            with log.open("a") as out:
                out.write(f"{now:%Y-%m-%d %H:%M:%S} ds_exp: the traceback of an unexpected error:\n{text}")
            return log
        except OSError:
            pass
    fallback = Path(tempfile.gettempdir()) / f"ds_exp-errors-{os.getuid()}"
    for folder, root in ((error_dir(), error_dir().parent), (fallback, fallback)):
        path = folder / f"{_running[0]}-{now:%Y%m%d-%H%M%S-%f}-{os.getpid()}.log"
        try:
            private_dir(folder, root=root)
            with os.fdopen(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as out:
                out.write(text)
            return path
        except (OSError, UnsafePath):
            continue
    return None


def error_dir() -> Path:
    """Where the tracebacks of commands that have no run directory go: ds_exp's folder of the user's cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "ds_exp" / "errors"


def full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def stdout_closed() -> bool:
    """Whether standard output's reader has gone (a pipe whose reader exited, as `head` does)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object with no descriptor (a test's capture)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def exit_on_error(check: Callable[[], T], what: str, after: str = "nothing was started") -> T:
    """Run a callback's check: Hydra 1.3 only warns when a callback raises, so whatever it raises exits here."""
    try:
        return check()
    except Exception as err:
        raise SystemExit(report_error(err, what=what, after=f"; {after}")) from None
