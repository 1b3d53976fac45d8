"""Data files as text: `.gz` read transparently, a UTF-8 BOM dropped (noted once), a binary file named like text
refused, and JSON objects with a repeated key refused (json keeps the last silently). Standard library."""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections import Counter
from collections.abc import Callable
from io import BufferedIOBase
from pathlib import Path
from typing import Any, Literal

from ds_exp.core.errors import DataError
from ds_exp.core.user_paths import special_file_problem

log = logging.getLogger(__name__)

BOM = "\ufeff"
_GZIP = b"\x1f\x8b"
# Leading bytes of files that are not text (no text file starts with them) -> (what it is, the fix)
_SIGNATURES: tuple[tuple[bytes, str, str], ...] = (
    (_GZIP, "gzip-compressed", "rename it to {name}.gz (gzip files are read directly)"),
    (b"PK\x03\x04", "a zip archive", "unzip it and point the path at the file inside"),
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it (unxz); only gzip is read directly"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it (unzstd); only gzip is read directly"),
    (b"ARROW1\x00\x00", "an Arrow IPC file", "convert it to Parquet or JSON lines"),
    (b"\xff\xfe", "UTF-16 text", "save it as UTF-8"),
    (b"\xfe\xff", "UTF-16 text", "save it as UTF-8"),
)
_noted_bom: set[str] = set()


def is_gzip_name(path: Path) -> bool:
    return path.suffix.lower() == ".gz"


def _what_it_is(path: Path, head: bytes) -> tuple[str, str] | None:
    """(what the file is, the fix) when its first bytes say it is not text; None for anything else."""
    for magic, what, fix in _SIGNATURES:
        if head.startswith(magic):
            return what, fix.format(name=path.name)
    if head.startswith(b"PAR1"):  # also a valid start of text: Parquet ends with PAR1 too
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - 4))
            if fh.read(4) == b"PAR1":
                return "a Parquet file", f"rename it to {path.name.split('.')[0]}.parquet, or set format=parquet"
    if head[:3] == b"BZh" and head[4:10] == b"1AY&SY":
        return "bzip2-compressed", "decompress it (bunzip2); only gzip is read directly"
    return None


def check_not_binary(path: Path, key: str, fmt: str) -> None:
    """Refuse a file whose first bytes say it is not `fmt` text (a gzip file named .jsonl), or a FIFO or device."""
    if (special := special_file_problem(key, path)) is not None:
        raise DataError(special)
    with path.open("rb") as fh:
        head = fh.read(16)
    if is_gzip_name(path):
        if not head.startswith(_GZIP):
            plain = path.name[: -len(path.suffix)]
            raise DataError(f"{key}: {path} is named .gz but is not gzip-compressed; rename it to {plain}")
        return
    found = _what_it_is(path, head)
    if found is not None:
        what, fix = found
        raise DataError(f"{key}: {path} is {what}, not {fmt} text; {fix}")


def note_bom(path: Path) -> None:
    if str(path) not in _noted_bom:
        _noted_bom.add(str(path))
        log.info("%s starts with a UTF-8 byte order mark (as Windows tools write it); it is ignored", path)


def read_text(path: Path, key: str, fmt: str) -> str:
    """The file's text (gunzipped when named .gz), without a leading byte order mark."""
    check_not_binary(path, key, fmt)
    if is_gzip_name(path):
        try:
            with gzip.open(path, "rb") as fh:
                data = fh.read()
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:  # a truncated or damaged gzip stream
            raise DataError(f"{key}: {path} is a damaged gzip file ({err}); compress or copy it again") from None
    else:
        data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{key}: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if text.startswith(BOM):
        note_bom(path)
        text = text[1:]
    return text


def starts_with_bom(path: Path) -> bool:
    """Whether the (decompressed) file starts with a UTF-8 byte order mark; for readers that skip it themselves."""
    opener: Callable[[Path, Literal["rb"]], BufferedIOBase] = gzip.open if is_gzip_name(path) else open
    try:
        with opener(path, "rb") as fh:
            return fh.read(3) == BOM.encode()
    except (EOFError, gzip.BadGzipFile, zlib.error):
        return False  # the reader reports it


class StrictJSON:
    """A reusable decoder that remembers every object holding a key twice: `repeated`, of the last document decoded."""

    def __init__(self) -> None:
        self.repeated: list[tuple[str, dict[str, Any]]] = []
        self._decoder = json.JSONDecoder(object_pairs_hook=self._object)

    def _object(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):  # rare: only then find which key
            self.repeated.append((repeated_columns([k for k, _ in pairs])[0], obj))
        return obj

    def loads(self, text: str) -> Any:
        self.repeated = []
        return self._decoder.decode(text)

    def repeated_in(self, value: object) -> str | None:
        """The repeated key of an object inside `value` (compared by identity), or None."""
        ids = {id(obj): k for k, obj in self.repeated}
        stack = [value]
        while stack:
            item = stack.pop()
            if id(item) in ids:
                return ids[id(item)]
            if isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
        return None


def repeated_key_error(key: str, where: str, repeated: str) -> DataError:
    return DataError(
        f"{key}: {where}: the key {repeated!r} appears twice in one object (JSON would keep only the last "
        "value); remove or rename one of them"
    )


def repeated_columns(names: list[str]) -> list[str]:
    """Names that occur more than once, in order of first occurrence."""
    counts = Counter(names)
    return [name for name in counts if counts[name] > 1]
