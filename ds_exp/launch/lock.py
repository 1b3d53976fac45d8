"""One live run per directory: an exclusive flock on <run dir>/.ds_exp.lock."""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Any

from ds_exp.core.errors import Refused

# ------------------------------------------------------------------------------------ one live run per directory
LOCK = ".ds_exp.lock"
_locks: dict[Path, tuple[Any, bool]] = {}  # run directory -> (the open file this process locks, whether it made it)


def lock_run_dir(run_dir: Path) -> None:
    """Hold <run dir>/.ds_exp.lock (an exclusive flock) until release_run_dir or the process's end. A second process
    that finds it held stops at once, naming the holder (claim_run_dir writes who that is, once a run goes ahead);
    a lock left by a killed process is released by the kernel with it, so a stale lock never blocks anyone."""
    run_dir = run_dir.absolute()
    if run_dir in _locks:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    while True:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, created = os.open(path, os.O_RDWR), False
            except FileNotFoundError:  # removed in between by a refused start that had created it
                continue
        handle = os.fdopen(fd, "r+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = handle.read().strip() or "another process, starting"
            handle.close()
            raise Refused(
                f"hydra.run.dir={run_dir} is in use by a live ds_exp run ({holder}); nothing was changed. Wait for "
                "it to end (or stop it), then resume=auto; or use another directory"
            ) from None
        try:  # the file we locked is still the one at the path (not one a refused start just removed)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        handle.close()
    _locks[run_dir] = (handle, created)


def claim_run_dir(run_dir: Path) -> None:
    """Write who holds the lock into it, once the run goes ahead (a refused start leaves the file as it was)."""
    handle, _ = _locks[run_dir.absolute()]
    handle.seek(0)
    handle.truncate()
    handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()


def release_run_dir(run_dir: Path, *, refused: bool = False) -> None:
    """Let the lock go; a refused start also removes the lock file if it created it (nothing of it stays)."""
    entry = _locks.pop(run_dir.absolute(), None)
    if entry is not None:
        handle, created = entry
        if refused and created:
            (run_dir.absolute() / LOCK).unlink(missing_ok=True)  # while still held: see the inode check above
        handle.close()  # closing the file releases the lock
