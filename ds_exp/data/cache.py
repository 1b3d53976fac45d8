"""The tokenized-data cache: `<cache_dir>/<key>/{train,eval}` (Arrow) and `meta.json` per settings hash, built once
under an `fcntl` lock into a temporary name renamed into place; the others wait on `<key>.lock`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from ds_exp.config.memory_plan import human_bytes
from ds_exp.config.secrets import redact_text
from ds_exp.core.errors import ConfigError
from ds_exp.core.files import json_text
from ds_exp.core.private_files import UnsafePath, cache_entry, private_dir
from ds_exp.core.waits import WaitGaveUp, announced_wait, duration

log = logging.getLogger(__name__)

META = "meta.json"
# Files up to this size are fingerprinted by content; bigger ones by size and modification time.
HASH_LIMIT = 64 * 1024 * 1024
T = TypeVar("T")  # what cached_build's `load` returns


def file_fingerprint(path: Path) -> dict[str, Any]:
    stat = path.stat()
    if stat.st_size <= HASH_LIMIT:
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        return {"size": stat.st_size, "sha256": digest.hexdigest()}
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def path_fingerprint(path: Path) -> dict[str, Any] | None:
    """Content fingerprint of a file or of every file under a directory (hidden files skipped)."""
    if path.is_file():
        return file_fingerprint(path)
    if path.is_dir():
        return {
            str(p.relative_to(path)): file_fingerprint(p)
            for p in sorted(path.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        }
    return None


def hash_key(material: object) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:20]


STALLED_BUILD_S = 60 * 60  # a live builder whose build wrote nothing for an hour is stuck: the wait stops


def _try_lock(fh: IO[str]) -> bool:
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def last_write(cache_dir: Path, key: str) -> float | None:
    """When a build of `key` last wrote into its directory (two levels down); None before it wrote anything."""
    times: list[float] = []
    for build in cache_dir.glob(f".{key}.tmp-*"):
        with contextlib.suppress(OSError):  # the build may finish (and be renamed) while it is looked at
            times.append(build.stat().st_mtime)
            for entry in build.iterdir():
                times.append(entry.stat().st_mtime)
                if entry.is_dir():
                    times += [inner.stat().st_mtime for inner in entry.iterdir()]
    return max(times, default=None)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive flock on `<cache dir>/<key>.lock` naming its holder; the wait gives up after STALLED_BUILD_S silent."""
    cache_dir, key = path.parent, path.stem
    with path.open("a+") as fh:
        if not _try_lock(fh):

            def holder() -> str:
                wrote = last_write(cache_dir, key)
                when = f"its build last wrote {duration(time.time() - wrote)} ago" if wrote else "nothing written yet"
                with contextlib.suppress(OSError):
                    return f"{path.read_text().strip() or 'another process'}; {when}"
                return when

            def released() -> bool:
                if _try_lock(fh):
                    return True
                wrote = last_write(cache_dir, key)
                if wrote is not None and time.time() - wrote > STALLED_BUILD_S:
                    raise WaitGaveUp(
                        f"data.cache_dir={cache_dir}: the process building the tokenized data {key} ({holder()}) "
                        "seems stuck; stop it, or point data.cache_dir at another directory, and run again"
                    )
                return False

            announced_wait(
                f"the tokenized data {key}, which another process is building",
                released,
                limit_s=None,
                fix="",
                detail=holder,
            )
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


_FULL = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up"}
_FULL_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT}


def disk_full(err: BaseException) -> int | None:
    """ENOSPC or EDQUOT when `err` (or what it wraps: datasets and Arrow re-raise it) says the disk filled up."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL:
            return current.errno
        for text, code in _FULL_TEXT.items():
            if text in str(current):
                return code
        current = current.__cause__ or current.__context__
    return None


def disk_full_message(err: BaseException, cache_dir: Path) -> str | None:
    """One line for a cache build that failed because the disk filled up; None for any other failure."""
    code = disk_full(err)
    if code is None:
        return None

    existing = cache_dir.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    return (
        f"data.cache_dir={cache_dir}: {_FULL[code]} ({human_bytes(free)} free) while writing the tokenized cache; "
        "free some space or point data.cache_dir at a larger disk"
    )


def read_meta(directory: Path) -> dict[str, Any] | None:
    """The entry's meta.json when it is what cached_build writes (else a miss: built again)."""
    return cache_entry(directory / META, {"key": str, "created": str, "stats": dict})


def cached_build(
    cache_dir: Path,
    key: str,
    build: Callable[[Path], dict[str, Any]],
    load: Callable[[Path], T],
    material: object,
) -> tuple[T, dict[str, Any], bool, Path]:
    """(loaded, meta, cache_hit, path) of `build(tmp)` / `load(dir)`; a directory failing to load is rebuilt once."""
    final = cache_dir / key
    try:  # the user's own directory, never a link or another's (a shared machine: ds_exp/core/private_files.py)
        private_dir(cache_dir)
    except UnsafePath as err:
        raise ConfigError(f"data.cache_dir={err}") from err  # the message starts with the path
    meta = read_meta(final)
    if meta is not None:  # fast path, no lock: a directory named <key> is complete by construction
        with contextlib.suppress(Exception):
            return load(final), meta, True, final
    with file_lock(cache_dir / f"{key}.lock"):
        meta = read_meta(final)
        if meta is not None:
            try:
                return load(final), meta, True, final
            except Exception as err:  # a broken cache entry is rebuilt, not fatal
                log.warning("cache %s is unreadable (%s); rebuilding it", final, err)
        if final.exists():
            shutil.rmtree(final)
        for stale in cache_dir.glob(f".{key}.tmp-*"):  # left by a build that crashed; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = cache_dir / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            stats = build(tmp)
            meta = {
                "key": key,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "stats": stats,
                "settings": material,
            }
            text = json_text(meta, indent=2, sort_keys=True) + "\n"
            (tmp / META).write_text(redact_text(text))  # a registered secret in a path or hub id stays out
            os.rename(tmp, final)  # atomic on one file system; final does not exist (we hold the lock)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return load(final), meta, False, final
