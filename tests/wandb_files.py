"""Read the records of a wandb offline run file (`run-<id>.wandb`) back.

wandb 0.31 no longer ships a Python reader; the file is LevelDB's log format (32 KiB blocks, 7-byte record
headers, records split as FIRST/MIDDLE/LAST) after a 7-byte ":W&B" file header, each record a protobuf
`wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert ident == b":W&B", f"{path} is not a wandb run file"
    out, offset, pending = [], _HEADER, b""
    while offset + _HEADER <= len(data):
        left = _BLOCK - offset % _BLOCK
        if left < _HEADER:
            offset += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + _HEADER])
        chunk = data[offset + _HEADER : offset + _HEADER + length]
        offset += _HEADER + length
        if kind in (_FIRST, _MIDDLE):
            pending += chunk
            continue
        if kind == _LAST:
            chunk, pending = pending + chunk, b""
        elif kind != _FULL:
            break  # zero padding at the end of the file
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        out.append(record)
    return out


def history(path: Path) -> dict[int, dict[str, Any]]:
    """{step: {key: value}} of every wandb.log call in the run file."""
    logged: dict[int, dict[str, Any]] = {}
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        logged[int(items["_step"])] = items
    return logged
