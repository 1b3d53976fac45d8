"""Where a run writes, checked before any heavy work: writable directories (before Hydra makes them), room for one
checkpoint plus the export (before the first step); a disk that fills later fails a save, never marked complete."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ds_exp.config.memory_plan import human_bytes
from ds_exp.core.errors import ConfigError, RunFailed
from ds_exp.core.files import disk_free_bytes, existing_ancestor

# the longest path a run writes below its directory, with room to spare (a conversion's per-parameter files)
RUN_FILES_MARGIN = 200


def check_path_length(path: Path, key: str, margin: int = RUN_FILES_MARGIN) -> None:
    """Each component of `path` within NAME_MAX and the run's files within PATH_MAX: said now, not as ENAMETOOLONG."""
    path = path.absolute()
    existing = Path(path.anchor)
    for part in path.parts[1:]:  # the deepest ancestor that exists (Path.exists raises on a name too long)
        try:
            if not (existing / part).exists():
                break
        except OSError:
            break
        existing = existing / part
    name_max = os.pathconf(existing, "PC_NAME_MAX")
    path_max = os.pathconf(existing, "PC_PATH_MAX")
    shown = str(path) if len(str(path)) <= 120 else f"{str(path)[:60]}...{str(path)[-40:]}"
    long = next((part for part in path.parts if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        raise ConfigError(
            f"{key}={shown}: the name {long[:40]}... has {len(os.fsencode(long))} bytes and this file system allows "
            f"{name_max} per name (NAME_MAX); choose a shorter {key}"
        )
    length = len(os.fsencode(str(path)))
    if length + margin > path_max:
        raise ConfigError(
            f"{key}={shown}: the path has {length} bytes, and the files a run writes inside it need up to about "
            f"{margin} more; this file system allows {path_max} (PATH_MAX): choose a shorter {key}"
        )


def check_writable(path: Path, key: str) -> None:
    """`path` is, or can be created as, a directory this process can write to."""
    check_path_length(path, key)
    existing = existing_ancestor(path)
    if not existing.is_dir():
        raise ConfigError(f"{key}={path}: {existing} is a file, not a directory; point {key} at a directory")
    read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    if read_only or not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if read_only else "is not writable by this user"
        raise ConfigError(f"{key}={path}: {existing} {why}; point {key} at a writable directory")


def check_free_space(needs: dict[Path, int], keys: dict[Path, str]) -> None:
    """Each file system must have room for what is bound for it (paths on one file system add up)."""
    names = {"train.checkpoint_dir": "one checkpoint", "train.export_dir": "the export"}
    per_device: dict[int, tuple[Path, int, list[str]]] = {}
    for path, size in needs.items():
        existing = existing_ancestor(path)
        device = existing.stat().st_dev
        first, total, what = per_device.get(device, (path, 0, []))
        per_device[device] = (first, total + size, [*what, names.get(keys[path], keys[path])])
    for path, needed, what in per_device.values():
        free = disk_free_bytes(path)
        if free < needed:
            raise RunFailed(
                f"not enough disk space for {keys[path]}={path}: {human_bytes(free)} free, {' and '.join(what)} "
                f"{'need' if len(what) > 1 else 'needs'} about {human_bytes(needed)}; free some space or point "
                f"{keys[path]} at a larger disk"
            )


def export_failure_message(exc: BaseException, export_dir: Path, needed: int) -> str | None:
    """Why an export failed for lack of room or rights (less room than the weights need: full), else None."""
    reason = _no_room(exc, export_dir, needed)
    if reason is None:
        return None
    return (
        f"could not write the export {export_dir} ({reason}; the weights alone need about {human_bytes(needed)}); "
        "nothing half-written was left and the checkpoints are as they were. Free some space (or point "
        "train.export_dir at a larger disk), then run again with the same overrides plus resume=auto (from a "
        "checkpoint at the final step it only evaluates and exports)"
    )


def _no_room(exc: BaseException, path: Path, needed: int) -> str | None:
    text = str(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
        return os.strerror(exc.errno)
    free = disk_free_bytes(path)
    if free < needed or "No space left" in text or "StorageFull" in text:
        return f"the disk is full: {human_bytes(free)} free"
    return None


def save_failure_message(exc: BaseException, tag_dir: Path, needed: int) -> str | None:
    """Why a save failed for lack of room or rights (less room than a checkpoint needs: full), else None."""
    free = disk_free_bytes(tag_dir)
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
