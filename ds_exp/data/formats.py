"""Source formats and how `format: auto` resolves them. Pure standard library: used by the config checks."""

from __future__ import annotations

import os
import re
from pathlib import Path

FILE_FORMATS = ("json", "jsonl", "csv", "parquet")
FORMATS = ("auto", *FILE_FORMATS, "arrow", "dschat", "hub")
_TEXT = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
# text may be gzip-compressed, read transparently (Parquet compresses inside the file)
EXTENSIONS = {**_TEXT, ".parquet": "parquet", ".pq": "parquet", **{f"{e}.gz": fmt for e, fmt in _TEXT.items()}}
# Files that mark a `datasets.save_to_disk` directory (a Dataset or a DatasetDict).
ARROW_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")
# Hub ids look like "name" or "owner/name"; anything else that does not exist is a missing local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def expand(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))


def dschat_files(directory: Path) -> tuple[Path, Path | None] | None:
    """(train, eval) files of DeepSpeed-Chat's local layout: train.json [+ eval.json], here or in data/."""
    for base in (directory, directory / "data"):
        for ext in (".json", ".jsonl"):
            train = base / f"train{ext}"
            if train.is_file():
                evals = [base / f"{name}{e}" for name in ("eval", "test") for e in (".json", ".jsonl")]
                return train, next((p for p in evals if p.is_file()), None)
    return None


def extension(path: str | Path) -> str:
    """The file's extension, lower case, with `.gz` kept together with the one before it (`.jsonl.gz`)."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if len(suffixes) >= 2 and suffixes[-1] == ".gz":
        return "".join(suffixes[-2:])
    return suffixes[-1] if suffixes else ""


def looks_like_hub_id(path: str) -> bool:
    if path.startswith(("/", ".", "~", "$")) or extension(path) in EXTENSIONS:
        return False
    return bool(_HUB_ID.match(path))


def resolve_format(path: str, fmt: str) -> str:
    """The concrete format of a source; raises ValueError with a message that says what to fix."""
    fmt = (fmt or "auto").lower()
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "hub":
        return fmt
    local = expand(path)
    if not local.exists():
        if fmt == "auto" and looks_like_hub_id(path):
            return "hub"
        raise ValueError(f"{local}: file not found; fix the path (hub ids need format=hub when ambiguous)")
    if local.is_dir():
        if fmt == "auto":
            if any((local / marker).is_file() for marker in ARROW_MARKERS):
                return "arrow"
            if dschat_files(local) is not None:
                return "dschat"
            raise ValueError(
                f"{local}: directory is neither a datasets.save_to_disk directory "
                f"({', '.join(ARROW_MARKERS)}) nor DeepSpeed-Chat's layout (train.json [+ eval.json]); "
                "point path at a data file instead"
            )
        if fmt == "dschat" and dschat_files(local) is None:
            raise ValueError(f"{local}: format=dschat needs train.json (and optionally eval.json) in it")
        if fmt == "arrow" and not any((local / marker).is_file() for marker in ARROW_MARKERS):
            raise ValueError(f"{local}: format=arrow needs a datasets.save_to_disk directory")
        if fmt in FILE_FORMATS:
            raise ValueError(f"{local}: format={fmt} needs a file, this is a directory")
        return fmt
    if fmt in ("arrow", "dschat"):
        raise ValueError(f"{local}: format={fmt} needs a directory, this is a file")
    if fmt == "auto":
        detected = EXTENSIONS.get(extension(local))
        if detected is None:
            raise ValueError(
                f"{local}: unknown file extension {extension(local) or '(none)'!r}; set format to one of "
                f"{', '.join(FILE_FORMATS)} (json, jsonl and csv may be gzipped: .jsonl.gz)"
            )
        return detected
    return fmt
