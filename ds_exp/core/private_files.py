"""Files and directories ds_exp keeps outside a run directory, on a machine others share (claims, tracebacks, caches,
build locks): each directory owner-only (0700), each component checked with lstat, never followed (a link, another
user's or a group-writable one is `UnsafePath`); files opened with O_NOFOLLOW. A cache entry that is not exactly what
ds_exp writes is a miss, said once and built again. Standard library only."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ds_exp.core.errors import DsExpError


class UnsafePath(DsExpError):
    """A place outside the run directory that ds_exp will not use: not its own, or not what it made."""


def private_dir(path: Path, root: Path | None = None) -> Path:
    """`path`, a directory only this user can write into, made (0700) where missing, checked from `root` down."""
    path = Path(path)
    root = Path(root) if root is not None else path
    below = path.relative_to(root).parts
    chain = [root, *(root.joinpath(*below[:n]) for n in range(1, len(below) + 1))]
    root.parent.mkdir(parents=True, exist_ok=True)
    for directory in chain:
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
        check_own(directory, directory=True)
    return path


def check_own(path: Path, *, directory: bool) -> None:
    """Refuse `path` (not followed) unless it is this user's own directory or regular file nobody else may write."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePath(f"{path} is a symbolic link; ds_exp does not follow links there: remove it and run again")
    if (directory and not stat.S_ISDIR(info.st_mode)) or (not directory and not stat.S_ISREG(info.st_mode)):
        kind = "a directory" if directory else "a regular file"
        raise UnsafePath(f"{path} is not {kind} ds_exp made: remove it (or move it away) and run again")
    if info.st_uid != os.getuid():
        raise UnsafePath(
            f"{path} belongs to another user (uid {info.st_uid}); ds_exp keeps its files in places of your own: remove "
            "it, or point ds_exp elsewhere"
        )
    if info.st_mode & 0o022:
        raise UnsafePath(f"{path} can be written by other users; make it yours alone (chmod go-w {path}) and run again")


def open_private(path: Path, flags: int) -> int:
    """os.open of a file in a private directory, never through a link, created owner-only."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def remove_own(folder: Path, name: re.Pattern[str], older_than_s: float = 0.0) -> None:
    """Delete this user's regular files in `folder` whose names match `name` older than `older_than_s`; nothing else."""
    now = time.time()
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                ours = stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and name.fullmatch(entry.name)
                if ours and now - info.st_mtime > older_than_s:
                    os.unlink(entry.path)
            except OSError:
                continue


log = logging.getLogger("ds_exp.cache")
_said_misses: set[Path] = set()


def cache_entry(
    path: Path, fields: Mapping[str, type | tuple[type, ...]], valid: Callable[[dict[str, Any]], bool] | None = None
) -> dict[str, Any] | None:
    """A cache entry's JSON object when each of `fields` has its type (and `valid` passes); None, said once, else."""
    try:
        entry = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        why = f"unreadable ({type(err).__name__})"
    else:
        wrong = [
            key for key, kind in fields.items() if not isinstance(entry, dict) or not isinstance(entry.get(key), kind)
        ]
        if not wrong and (valid is None or valid(entry)):
            return entry
        why = f"{', '.join(wrong)} missing or of another type" if wrong else "its contents are of another shape"
    if path not in _said_misses:
        _said_misses.add(path)
        log.warning("cache entry %s is not what ds_exp writes (%s): built again", path, why)
    return None
