"""One live run per directory, one live sweep per sweep directory: an exclusive flock on <dir>/.ds_exp.lock."""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import socket
import stat
import time
from pathlib import Path
from typing import TextIO

from ds_exp.core.errors import Refused

LOCK = ".ds_exp.lock"
# run / sweep directory -> (the open file this process locks, whether it made it, the outermost directory it made)
_locks: dict[Path, tuple[TextIO, bool, Path | None]] = {}
_sweep_locks: dict[Path, tuple[TextIO, bool, Path | None]] = {}


def lock_run_dir(run_dir: Path, *, key: str = "hydra.run.dir") -> None:
    """Hold <run dir>/.ds_exp.lock (an flock the kernel drops with its process) until release_run_dir or exit."""
    _take(run_dir.absolute(), _locks, key, "run")


def _take(directory: Path, locks: dict[Path, tuple[TextIO, bool, Path | None]], key: str, what: str) -> bool:
    """Make and lock `directory` into `locks`; False when this process holds it already."""
    if directory in locks:
        return False
    made = _first_missing(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        locks[directory] = (*_open_and_lock(directory, key, what), made)
    except BaseException:
        _remove_made(directory, made)
        raise
    return True


def made_here(run_dir: Path) -> bool:
    """Whether this process made the run directory it locked (it did not exist before this run)."""
    entry = _locks.get(run_dir.absolute())
    return entry is not None and entry[2] is not None


def made_run_dirs() -> list[Path]:
    """The run directories this process locked and made (they did not exist before its run)."""
    return [run_dir for run_dir, (_, _, made) in _locks.items() if made is not None]


def claim_run_dir(run_dir: Path) -> None:
    """Write who holds the lock into it, once the run goes ahead (a refused start leaves the file as it was)."""
    _write_holder(_locks[run_dir.absolute()][0])


def release_run_dir(run_dir: Path, *, refused: bool = False) -> None:
    """Let the lock go and remove its file; a refused start removes only what it made (its file, empty dirs)."""
    entry = _locks.pop(run_dir.absolute(), None)
    if entry is not None:
        handle, created, made = entry
        if created or not refused:
            (run_dir.absolute() / LOCK).unlink(missing_ok=True)  # while still held
        handle.close()  # closing the file releases the lock
        if refused:
            _remove_made(run_dir.absolute(), made)


_ATTEMPTS = 20  # opening the lock file races only with a refused start removing the file it made: a few tries do


def _lock_error(run_dir: Path, key: str, detail: str, fix: str) -> Refused:
    """`key` names the setting that chose the directory ("" for a sweep job's, which its job line names)."""
    return Refused(f"{f'{key}={run_dir}: ' if key else ''}{detail}; nothing was changed. {fix}")


def _not_a_lock_file(path: Path, run_dir: Path, key: str) -> Refused | None:
    """Why the thing at `path` cannot be ds_exp's lock file (None: a regular file, or nothing); never follows links."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        target = os.readlink(path)
        dangling = "" if path.exists() else ", which does not exist"
        return _lock_error(
            run_dir,
            key,
            f"{path} is a symbolic link (to {target}{dangling}), not ds_exp's lock file",
            f"ds_exp never makes it a link: remove the link (rm {path}) and start again",
        )
    kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a fifo, socket or device)"
    return _lock_error(
        run_dir,
        key,
        f"{path} is {kind}, not ds_exp's lock file",
        f"Move it out of the run directory (ds_exp makes {LOCK} a plain file there), then start again",
    )


def _os_error(err: OSError, path: Path, run_dir: Path, key: str) -> Refused:
    if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
        return _lock_error(
            run_dir,
            key,
            f"the file system of {path} does not support file locks ({err.strerror})",
            "ds_exp locks the directory so that no other run writes into it: use a directory on a local or "
            "lock-capable file system",
        )
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return _lock_error(
            run_dir,
            key,
            f"{path} cannot be opened for writing ({err.strerror})",
            "Give this user write access to it (or remove it if no run uses the directory), or use another directory",
        )
    return _lock_error(run_dir, key, f"{path} cannot be locked ({err.strerror})", "Fix that, or use another directory")


def _open_and_lock(run_dir: Path, key: str, what: str) -> tuple[TextIO, bool]:
    """(the open lock file, whether this call made it), locked exclusively; each failure one Refused."""
    path = run_dir / LOCK
    for _ in range(_ATTEMPTS):
        problem = _not_a_lock_file(path, run_dir, key)
        if problem is not None:
            raise problem
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), True
        except FileExistsError:
            try:
                fd, created = os.open(path, os.O_RDWR | os.O_NOFOLLOW), False
            except FileNotFoundError:  # removed in between by a refused start that had created it
                continue
            except OSError as err:
                raise _not_a_lock_file(path, run_dir, key) or _os_error(err, path, run_dir, key) from None
        except OSError as err:
            raise _not_a_lock_file(path, run_dir, key) or _os_error(err, path, run_dir, key) from None
        handle = os.fdopen(fd, "r+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = handle.read().strip() or "another process, starting"
            handle.close()
            raise Refused(
                f"{key}={run_dir} is in use by a live ds_exp {what} ({holder}); nothing was changed. Wait for "
                f"it to end (or stop it), then resume=auto; or use another directory"
            ) from None
        except OSError as err:
            handle.close()
            if created:
                path.unlink(missing_ok=True)
            raise _os_error(err, path, run_dir, key) from None
        try:  # the file we locked is still the one at the path (not one a refused start just removed)
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return handle, created
        except FileNotFoundError:
            pass
        handle.close()
    raise _lock_error(
        run_dir,
        key,
        f"{path} kept disappearing while it was being locked ({_ATTEMPTS} tries)",
        "Another program removes it: stop that, or use another directory",
    )


def _write_holder(handle: TextIO) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()


def lock_sweep_dir(sweep_dir: Path) -> None:
    """One live sweep per sweep directory, taken before it is checked; jobs lock their own run directories."""
    sweep_dir = sweep_dir.absolute()
    if _take(sweep_dir, _sweep_locks, "hydra.sweep.dir", "sweep"):
        # a sweep refused later (a bad job, a sweeper's own refusal) leaves nothing behind: not even the directory
        atexit.register(release_sweep_dir, sweep_dir)


def claim_sweep_dir(sweep_dir: Path) -> None:
    _write_holder(_sweep_locks[sweep_dir.absolute()][0])


def release_sweep_dir(sweep_dir: Path) -> None:
    """Let the sweep's lock go: its file and the empty directories this process made go too."""
    entry = _sweep_locks.pop(sweep_dir.absolute(), None)
    if entry is None:
        return
    handle, created, made = entry
    if created:
        (sweep_dir.absolute() / LOCK).unlink(missing_ok=True)  # still held: one opening it now sees another inode
    handle.close()
    _remove_made(sweep_dir.absolute(), made)


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of `path` that does not exist yet (what mkdir(parents=True) will make)."""
    missing = None
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            break
        missing = candidate
    return missing


def _remove_made(directory: Path, made: Path | None) -> None:
    """Remove the directories from `directory` up to `made` that are empty (what a refused start made)."""
    if made is None:
        return
    for candidate in (directory, *directory.parents):
        try:
            candidate.rmdir()  # only an empty directory goes
        except OSError:
            return
        if candidate == made:
            return


def live_holder(directory: Path) -> str | None:
    """Who holds <directory>/.ds_exp.lock, if another live process does; only looks (a shared lock for an instant)."""
    directory = directory.absolute()
    if directory in _locks or directory in _sweep_locks:
        return None
    path = directory / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # missing, or not a lock file (then taking the lock says so)
    with os.fdopen(fd) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read().strip() or "another process, starting"
        except OSError:
            return None
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def live_ancestor(run_dir: Path) -> tuple[Path, str] | None:
    """The nearest directory above `run_dir` a live ds_exp run or sweep holds, with the holder."""
    for parent in run_dir.absolute().parents:
        holder = live_holder(parent)
        if holder is not None:
            return parent, holder
    return None
