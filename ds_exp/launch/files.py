"""Files written whole or not at all: a reader (a resume, the sweep report, a person) never sees half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, then rename it into place (atomic on one file system)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, payload: Any) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")
