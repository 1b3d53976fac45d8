"""Files written whole or not at all. JSON is strict (no bare NaN): a non-finite number is written as null and named in
the object's `non_finite` list (`{"loss": null, "non_finite": ["loss"]}`)."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

NON_FINITE = "non_finite"
# A full disk as libraries that wrap the OSError say it (SQLite, safetensors, torch's zip writer)
_FULL_DISK_TEXTS = ("No space left on device", "database or disk is full", "Disk quota exceeded", "StorageFull")


def finite_tree(payload: object, path: str = "") -> tuple[Any, list[str]]:
    """`payload` as plain JSON values, non-finite numbers None, and the dotted paths of those numbers."""
    if isinstance(payload, dict):
        out, bad = {}, []
        for key, value in payload.items():
            out[str(key)], inner = finite_tree(value, f"{path}{key}.")
            bad += inner
        return out, bad
    if isinstance(payload, (list, tuple)):
        items, bad = [], []
        for index, value in enumerate(payload):
            item, inner = finite_tree(value, f"{path}{index}.")
            items.append(item)
            bad += inner
        return items, bad
    if payload is None or isinstance(payload, (str, bool, int)):
        return payload, []
    if isinstance(payload, float):
        return (payload, []) if math.isfinite(payload) else (None, [path.rstrip(".")])
    item = getattr(payload, "item", None)  # numpy scalars, one-element tensors
    if callable(item) and getattr(payload, "ndim", 0) == 0:
        return finite_tree(item(), path)
    return str(payload), []


def json_text(payload: object, *, indent: int | None = None, ensure_ascii: bool = True, sort_keys: bool = False) -> str:
    """Strict JSON for `payload`; a dict at the top records its non-finite numbers."""
    clean, bad = finite_tree(payload)
    if bad and isinstance(clean, dict):
        found = clean.get(NON_FINITE)
        earlier: list[Any] = found if isinstance(found, list) else []
        clean[NON_FINITE] = [*earlier, *(b for b in bad if b not in earlier)]
    return json.dumps(clean, indent=indent, allow_nan=False, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def restore_non_finite(record: dict[str, Any]) -> dict[str, Any]:
    """A record read back as written: the numbers its `non_finite` list names are NaN again, the list gone."""
    names = record.get(NON_FINITE) if isinstance(record, dict) else None
    if not isinstance(names, list):
        return record
    out = {k: v for k, v in record.items() if k != NON_FINITE}
    for name in names:
        *parents, last = str(name).split(".")
        node: object = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(last) is None:
            node[last] = math.nan
    return out


def write_text_atomic(path: Path, text: str) -> None:
    """Write beside `path`, then rename into place: a failed write leaves `path` as it was and no temporary file."""
    _replace_whole(path, lambda tmp: tmp.write_text(text))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """write_text_atomic for bytes: a picture (a run's plots/loss.png, a sweep's report.png) is replaced whole."""
    _replace_whole(path, lambda tmp: tmp.write_bytes(data))


def _replace_whole(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, payload: object) -> None:
    write_text_atomic(path, json_text(payload, indent=2) + "\n")


def append_json_line(handle: IO[str], record: dict[str, Any], *, ensure_ascii: bool = True) -> None:
    """One record of a JSON-lines file (metrics.jsonl, generations.jsonl)."""
    handle.write(json_text(record, ensure_ascii=ensure_ascii) + "\n")


def append_whole(file: io.FileIO, data: bytes, path: Path) -> None:
    """Append `data` to `file` whole, or cut the file back and raise (a buffered write could leave a part behind)."""
    size = os.fstat(file.fileno()).st_size
    try:
        view = memoryview(data)
        while view:
            written = file.write(view)
            if not written:  # a regular file takes something or raises; never loop on nothing
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            view = view[written:]
    except OSError:
        with contextlib.suppress(OSError):
            os.truncate(file.fileno(), size)  # gives room back: never fails for lack of it
        raise


def no_room(err: BaseException) -> str | None:
    """Why `err` (or a cause in its chain) is a write that found no room, in a few words; None for any other error."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return os.strerror(seen.errno)
        text = str(seen)
        found = next((t for t in _FULL_DISK_TEXTS if t in text), None)
        if found is not None:
            return "No space left on device" if found == "StorageFull" else found
        seen = seen.__cause__ or seen.__context__
    return None


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when it is missing, unreadable or not an object."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_free_bytes(path: Path) -> int:
    """Room left for this user on the disk holding `path` (its nearest existing ancestor)."""
    stat = os.statvfs(existing_ancestor(path))
    return stat.f_bavail * stat.f_frsize


def same_disk(a: Path, b: Path) -> bool:
    """Whether `a` and `b` (or their nearest existing ancestors) are on one file system."""
    return existing_ancestor(a).stat().st_dev == existing_ancestor(b).stat().st_dev
