"""torch's extension build lock, told live from stale (torch polls a leftover forever): `HeldBaton` also holds an flock
the OS drops with its process, so a lock whose holder died is removed, said, and the op built again."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO

from torch.utils.file_baton import FileBaton

from ds_exp.core import compat
from ds_exp.core.errors import RunFailed
from ds_exp.core.private_files import check_own, open_private
from ds_exp.core.waits import announce, announced_wait

HOLDER_SUFFIX = ".holder"
BUILD_LIMIT_S = 60 * 60  # builds here took 1-8 minutes: an hour means the other build is stuck


class BuildLockBroken(RunFailed):
    """The build this process waited for ended without finishing (its process died)."""


def _take(holder_path: str) -> IO[str] | None:
    """The holder file, flocked by this process; None while another process holds it."""
    # held past this function, closed by _let_go; never through a link planted there (ds_exp/core/private_files.py)
    handle = os.fdopen(open_private(Path(holder_path), os.O_RDWR | os.O_CREAT | os.O_APPEND), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _let_go(handle: IO[str]) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()


def holder_of(holder_path: str) -> str | None:
    """Who holds (or last held) the lock, as its holder wrote it: `pid N on HOST since TIME`."""
    try:
        return Path(holder_path).read_text().strip() or None
    except OSError:
        return None


def opened_by(path: str) -> int | None:
    """A process of this machine that has `path` open (from /proc: other users' only with the right), or None."""
    target = os.path.realpath(path)
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == target:
                        return int(fd_dir.parent.name)
    return None


RELEASE_GRACE_S = 0.5  # torch's FileBaton.release closes the file, then removes it: not a leftover in between


def _left_behind(lock: str) -> bool:
    """Whether `lock` (its flock held by the caller) is open nowhere, still so a moment later."""
    for attempt in range(2):
        if not os.path.exists(lock) or opened_by(lock) is not None:
            return False
        if attempt == 0:
            time.sleep(RELEASE_GRACE_S)
    return True


def _remove_leftover(lock: str) -> None:
    """Remove a lock file no live process holds, and say so; a link or another user's file is refused in one line."""
    with contextlib.suppress(FileNotFoundError):
        check_own(Path(lock), directory=False)
        os.remove(lock)
    announce(
        f"{lock} was left by a build that was killed (no process holds it): removed, and the op is built again",
    )


class HeldBaton(FileBaton):
    """torch's FileBaton with an flock beside it: see the module docstring."""

    def __init__(self, lock_file_path: str, wait_seconds: float = 0.1, warn_after_seconds: float | None = None):
        super().__init__(lock_file_path, wait_seconds, warn_after_seconds)
        self.holder_path = lock_file_path + HOLDER_SUFFIX
        self.holder: IO[str] | None = None

    def try_acquire(self) -> bool:
        holder = _take(self.holder_path)
        if holder is None:
            return False  # another ds_exp process holds it: torch calls wait()
        try:
            if _left_behind(self.lock_file_path):
                _remove_leftover(self.lock_file_path)
            acquired = bool(super().try_acquire())  # False: held by a program that does not take the flock
        except BaseException:
            _let_go(holder)
            raise
        if not acquired:
            _let_go(holder)
            return False
        holder.seek(0)
        holder.truncate()
        holder.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        holder.flush()
        self.holder = holder
        return True

    def release(self) -> None:
        try:
            super().release()
        finally:
            if self.holder is not None:
                _let_go(self.holder)
                self.holder = None

    def wait(self) -> None:
        lock = self.lock_file_path
        op = Path(lock).parent.name
        announced_wait(
            f"the build of {op} in another process",
            self._released,
            limit_s=BUILD_LIMIT_S,
            fix=f"if no build of {op} is running, remove {lock} and run again",
            detail=lambda: f"{holder_of(self.holder_path) or _opened_note(lock)} holds {lock}",
            poll_s=self.wait_seconds,
        )

    def _released(self) -> bool:
        """Whether torch's lock is gone; raises BuildLockBroken when its holder died without finishing."""
        lock = self.lock_file_path
        if not os.path.exists(lock):
            return True
        holder = _take(self.holder_path)
        if holder is None:
            return False  # a live ds_exp process holds it
        try:
            if not _left_behind(lock):
                return not os.path.exists(lock)  # released meanwhile, or a live program that is not ds_exp holds it
            _remove_leftover(lock)
        finally:
            _let_go(holder)
        raise BuildLockBroken(
            f"the build of {Path(lock).parent.name} this run waited for ended without finishing (its process was "
            f"killed) and left {lock}, removed now; run again to build it"
        )


def _opened_note(lock: str) -> str:
    pid = opened_by(lock)
    return f"pid {pid}" if pid is not None else "a process"


def guard_builds() -> None:
    """From now on, torch's extension builds in this process take HeldBaton as their lock (idempotent)."""
    compat.use_extension_baton(HeldBaton)
