"""Every wait on something outside the process says within NOTICE_S seconds what it waits for and since when, and either
ends or stops with one line naming what to do (rank 0 on the console, every rank in its log). Standard library only."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from ds_exp.core.errors import RunFailed

NOTICE_S = 5.0  # the first notice: well within the 10 s a person waits before wondering
NOTICE_GROWTH = 3.0  # then after 15 s, 45 s, 135 s, ... at most every MAX_INTERVAL_S
MAX_INTERVAL_S = 600.0
POLL_S = 0.2
PROBE_TIMEOUT_S = 3.0  # a server that does not answer a TCP connection in 3 s is not one to train against
PROBE_MEMORY_S = 60.0  # a sweep checks its jobs one after another: one probe of a server answers them all
_probed: dict[tuple[str, int], tuple[float, str | None]] = {}
# file only, never the console: ds_exp.launch.run_logging.FILE_LOGGER (core imports nothing above it)
_file_log = logging.getLogger("ds_exp.file")
T = TypeVar("T")


class WaitGaveUp(RunFailed):
    """A wait passed its limit: the message names what it waited for, since when, and what to do."""


def rank_speaks() -> bool:
    """Whether this process is rank 0 (RANK is exported for every launcher before the first wait on a peer)."""
    value = os.environ.get("RANK", "0").strip()
    return not value.isdigit() or int(value) == 0


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.1f} h"


class Wait:
    """A polling loop's wait: `tick()` says notices when due, WaitGaveUp past `limit_s`; `detail()`: what is known."""

    def __init__(
        self,
        what: str,
        *,
        limit_s: float | None,
        fix: str,
        detail: Callable[[], str | None] | None = None,
        speak: bool | None = None,
        notice_s: float | None = None,
        bound: str | None = None,
    ) -> None:
        self.what, self.limit_s, self.fix, self.detail, self.bound = what, limit_s, fix, detail, bound
        self.speak = rank_speaks() if speak is None else speak
        self.started = time.monotonic()
        self.since = time.strftime("%H:%M:%S")
        self.next_notice = NOTICE_S if notice_s is None else notice_s

    @property
    def waited(self) -> float:
        return time.monotonic() - self.started

    def _detail(self) -> str:
        try:
            found = self.detail() if self.detail is not None else None
        except OSError:  # what the detail reads went away meanwhile
            found = None
        return f" ({found})" if found else ""

    def tick(self) -> None:
        """Call once each time round the loop: a notice when one is due; WaitGaveUp past the limit."""
        waited = self.waited
        if self.limit_s is not None and waited >= self.limit_s:
            raise WaitGaveUp(
                f"gave up waiting for {self.what}{self._detail()} after {duration(waited)} (since {self.since}); "
                f"{self.fix}"
            )
        if waited >= self.next_notice:
            limit = f"; gives up after {duration(self.limit_s)}" if self.limit_s is not None else ""
            limit = f"; {self.bound}" if self.bound else limit  # what bounds it, when that is not this wait's limit
            self.say(f"waiting for {self.what}{self._detail()} since {self.since} ({duration(waited)}{limit})")
            self.next_notice = waited + min(MAX_INTERVAL_S, max(self.next_notice, 1.0) * (NOTICE_GROWTH - 1))

    def say(self, line: str) -> None:
        announce(line, speak=self.speak)


def announce(line: str, *, speak: bool | None = None) -> None:
    """One line about a wait: on rank 0's console, and in every rank's log file."""
    _file_log.info(line)
    if rank_speaks() if speak is None else speak:
        print(f"ds_exp: {line}", file=sys.stderr, flush=True)


def announced_wait(
    what: str,
    done: Callable[[], bool],
    *,
    limit_s: float | None,
    fix: str,
    detail: Callable[[], str | None] | None = None,
    speak: bool | None = None,
    poll_s: float = POLL_S,
    notice_s: float | None = None,
) -> float:
    """Poll `done()` until it holds, announced; returns the seconds waited. Raises WaitGaveUp past `limit_s`."""
    wait = Wait(what, limit_s=limit_s, fix=fix, detail=detail, speak=speak, notice_s=notice_s)
    while not done():
        wait.tick()
        time.sleep(poll_s)
    return wait.waited


def run_announced(
    what: str,
    call: Callable[[], T],
    *,
    limit_s: float | None,
    fix: str,
    speak: bool | None = None,
    notice_s: float | None = None,
    bound: str | None = None,
) -> T:
    """`call()` in a helper thread, announced, its exception raised here; past `limit_s` the thread is left behind."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"ds_exp-wait: {what[:40]}", daemon=True)
    wait = Wait(what, limit_s=limit_s, fix=fix, speak=speak, notice_s=notice_s, bound=bound)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=POLL_S)  # signal handlers run in this thread between the joins
        if thread.is_alive():
            wait.tick()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]  # a BaseException, set above
    return outcome["value"]  # type: ignore[return-value]  # what call() returned


@contextlib.contextmanager
def announced(what: str, *, bound: str, speak: bool | None = None, notice_s: float | None = None) -> Iterator[None]:
    """Notices about the wait on `what` while the block runs; its own call is bounded by its library (`bound`)."""
    wait = Wait(what, limit_s=None, fix="", speak=speak, notice_s=notice_s, bound=bound)
    with _every_poll(f"ds_exp-wait: {what[:40]}", wait.tick):
        yield


@contextlib.contextmanager
def _every_poll(name: str, step: Callable[[], None]) -> Iterator[None]:
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(POLL_S):
            step()

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def announce_while(
    what: str,
    *,
    idle_s: Callable[[], float] | None = None,
    detail: Callable[[], str | None] | None = None,
    speak: bool | None = None,
    notice_s: float | None = None,
) -> Iterator[None]:
    """Notices about this process's work while the block runs (no limit); with `idle_s()`, only while that grows."""
    notice_s = due = NOTICE_S if notice_s is None else notice_s
    started, since = time.monotonic(), time.strftime("%H:%M:%S")
    quiet = idle_s or (lambda: time.monotonic() - started)

    def check() -> None:
        nonlocal due
        idle = quiet()
        if idle < notice_s:
            due = notice_s  # it moved: the next silence is told after notice_s again
        elif idle >= due:
            found = detail() if detail is not None else None
            announce(
                f"{what}: no sign of progress for {duration(idle)}, still working "
                f"(since {since}{'; ' + found if found else ''})",
                speak=speak,
            )
            due = idle + min(MAX_INTERVAL_S, max(due, 1.0) * (NOTICE_GROWTH - 1))

    with _every_poll(f"ds_exp-working: {what[:40]}", check):
        yield


def unreachable(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why a TCP connection to (host, port) does not open within `timeout_s`, None when it does; cached."""
    now = time.monotonic()
    known = _probed.get((host, port))
    if known is not None and now - known[0] < PROBE_MEMORY_S:
        return known[1]
    result: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            result.append(None)
        except OSError as err:
            result.append(err.strerror or type(err).__name__)

    thread = threading.Thread(target=probe, name="ds_exp-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    why = result[0] if result else f"no answer in {timeout_s:g} s"
    _probed[(host, port)] = (now, why)
    return why
