"""Where a run writes, checked before any heavy work: directories that can be written, and room on the disk.

* `check_writable` runs before Hydra creates the run (or sweep) directory (ds_exp.launch.run_dir's callback), so
  an unwritable `hydra.run.dir` gets one message instead of Hydra's traceback.
* `check_free_space` runs once the model is built and before the first step: one checkpoint plus the export
  must fit on the disk that holds them. A disk that fills up later is caught when a save fails
  (`save_failure_message`): the checkpoint is never marked complete, so resume never picks it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ds_exp.config.memory_plan import human_bytes
from ds_exp.core.errors import ConfigError, RunFailed


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(path: Path, key: str) -> None:
    """`path` is, or can be created as, a directory this process can write to."""
    existing = _existing_ancestor(path)
    if not existing.is_dir():
        raise ConfigError(f"{key}={path}: {existing} is a file, not a directory; point {key} at a directory")
    read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    if read_only or not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if read_only else "is not writable by this user"
        raise ConfigError(f"{key}={path}: {existing} {why}; point {key} at a writable directory")


def check_free_space(needs: dict[Path, int], keys: dict[Path, str]) -> None:
    """Each file system must have room for what is bound for it (paths on one file system add up)."""
    per_device: dict[int, tuple[Path, int]] = {}
    for path, size in needs.items():
        existing = _existing_ancestor(path)
        device = existing.stat().st_dev
        first, total = per_device.get(device, (path, 0))
        per_device[device] = (first, total + size)
    for path, needed in per_device.values():
        free = _free_bytes(_existing_ancestor(path))
        if free < needed:
            raise RunFailed(
                f"not enough disk space for {keys[path]}={path}: {human_bytes(free)} free, one checkpoint and the "
                f"export need about {human_bytes(needed)}; free some space or point {keys[path]} at a larger disk"
            )


def _free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def save_failure_message(exc: BaseException, tag_dir: Path, needed: int) -> str | None:
    """A person's message for a save that failed for lack of room or rights; None for other failures.
    torch.save reports a full disk as a RuntimeError of its zip writer ("unexpected pos ..."), so a failure
    with less room left than a checkpoint needs counts as a full disk whatever its type."""
    free = _free_bytes(_existing_ancestor(tag_dir))
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
        reason = os.strerror(exc.errno)
    elif free < needed:
        reason = f"the disk is full: {human_bytes(free)} free, a checkpoint needs about {human_bytes(needed)}"
    else:
        return None
    return (
        f"could not write checkpoint {tag_dir} ({reason}); it is incomplete and will never be resumed from. "
        f"Free some space (or fix the directory), then continue from the last complete checkpoint with resume=auto"
    )
