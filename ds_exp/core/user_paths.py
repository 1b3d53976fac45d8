"""User paths that are not files to read (a FIFO waits forever, a device never ends, a socket), told by os.stat
before anything opens them: one line naming the setting and the fix. Layer 0: the standard library only."""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe): opening it waits for a writer, forever if none comes"),
    (stat.S_ISCHR, "a character device (like /dev/zero or a terminal): reading it never ends, or waits for input"),
    (stat.S_ISBLK, "a block device (a whole disk), not a file"),
    (stat.S_ISSOCK, "a socket, not a file"),
)


def special_kind(path: str | os.PathLike[str]) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a directory; None otherwise."""
    try:
        mode = os.stat(Path(path).expanduser()).st_mode  # stat never opens it: a FIFO does not block here
    except (OSError, ValueError):
        return None
    return next((what for test, what in _KINDS if test(mode)), None)


def special_file_problem(key: str, path: str | os.PathLike[str]) -> str | None:
    """One line when the path a setting names is a FIFO, a device or a socket: `<key>: <path> is <what>; <fix>`."""
    what = special_kind(path)
    if what is None:
        return None
    return f"{key}: {path} is {what}; give the path of a regular file (copy what it holds into one)"
