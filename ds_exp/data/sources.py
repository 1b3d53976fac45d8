"""Reading every source kind into plain prompt/chosen/rejected columns.

Rows are read into Python lists (not into the `datasets` cache under ~/.cache/huggingface): the only cache
is ours, keyed on the file contents, and JSON is parsed by us so a bad row is reported by file and line.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_exp.data.checks import _get
from ds_exp.data.formats import dschat_files, expand, resolve_format
from ds_exp.errors import DataError

log = logging.getLogger(__name__)

EVAL_SPLIT_NAMES = ("eval", "validation", "valid", "test")


@dataclass
class Rows:
    """One split of one source, already filtered: every row has a prompt and a non-blank answer."""

    prompt: list[str] = field(default_factory=list)
    chosen: list[str] = field(default_factory=list)
    rejected: list[str | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt)

    def take(self, indices: Any) -> Rows:
        return Rows(
            [self.prompt[i] for i in indices],
            [self.chosen[i] for i in indices],
            [self.rejected[i] for i in indices],
        )

    def extend(self, other: Rows) -> None:
        self.prompt += other.prompt
        self.chosen += other.chosen
        self.rejected += other.rejected


@dataclass
class RawSource:
    key: str  # config key, e.g. data.sources[0]; starts every message about this source
    train: Rows
    eval: Rows | None  # None = the source has no eval split (eval_fraction is carved out instead)
    num_filtered: int = 0  # rows dropped for a missing prompt or a blank answer


# ----------------------------------------------------------------------------------------------- readers


def _json_records(path: Path, key: str) -> list[dict[str, Any]]:
    """A JSON array of objects, an object of columns (or of one list of records), or JSON lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{key}: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text.strip():
        return []
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as err:
        # "Extra data" = a first document parsed and more follow: JSON lines. Otherwise the file is one
        # broken document and the decoder's position is the answer.
        if err.msg != "Extra data":
            raise DataError(f"{key}: {path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
        return _json_lines(text, path, key)
    if isinstance(whole, list):
        bad = next((i for i, row in enumerate(whole) if not isinstance(row, dict)), None)
        if bad is not None:
            raise DataError(f"{key}: {path}: item {bad} of the JSON array is not an object")
        return whole
    if not isinstance(whole, dict):
        raise DataError(f"{key}: {path}: expected JSON objects, got a {type(whole).__name__}")
    values = list(whole.values())
    if values and all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
        if len(values) == 1 and all(isinstance(r, dict) for r in values[0]):
            return values[0]  # {"data": [{...}, ...]}
        return [dict(zip(whole, row, strict=True)) for row in zip(*values, strict=True)]  # {"prompt": [...]}
    return [whole]  # a single record


def _json_lines(text: str, path: Path, key: str) -> list[dict[str, Any]]:
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{key}: {path}:{lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{key}: {path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
        records.append(row)
    return records


def _columns_of_records(records: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for row in records:
        for k in row:
            seen.setdefault(k, None)
    return list(seen)


class _Table:
    """Column names plus a way to fetch one column as a list, whatever the storage."""

    def __init__(self, columns: list[str], getter: Any, n: int) -> None:
        self.columns, self.get, self.n = columns, getter, n


def _read_file(path: Path, fmt: str, key: str, fields: list[str]) -> _Table:
    if fmt in ("json", "jsonl"):
        records = _json_records(path, key)
        return _Table(_columns_of_records(records), lambda f: [r.get(f) for r in records], len(records))
    import pyarrow as pa

    try:
        if fmt == "csv":
            import pyarrow.csv as pacsv

            # answers that look like numbers stay text; missing columns in column_types are ignored
            opts = pacsv.ConvertOptions(column_types={f: pa.string() for f in fields})
            table = pacsv.read_csv(path, convert_options=opts)
        else:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{key}: {path}: cannot read as {fmt}: {str(err).splitlines()[0]}") from None
    return _Table(table.column_names, lambda f: table.column(f).to_pylist(), table.num_rows)


def _read_dataset(ds: Any) -> _Table:
    return _Table(list(ds.column_names), lambda f: ds[f], len(ds))


def _pick_splits(dd: Any, src: Any, key: str, label: str) -> tuple[Any, Any | None]:
    """(train, eval or None) out of a DatasetDict, following split / eval_split."""
    names = list(dd.keys())
    split = _get(src, "split", "train")
    if split not in dd:
        raise DataError(f"{key}.split={split}: {label} has no such split; it has {', '.join(names)}")
    eval_split = _get(src, "eval_split", "auto")
    if eval_split is None:
        return dd[split], None
    if eval_split == "auto":
        found = next((n for n in EVAL_SPLIT_NAMES if n in dd and n != split), None)
        return dd[split], dd[found] if found else None
    if eval_split not in dd:
        raise DataError(f"{key}.eval_split={eval_split}: {label} has no such split; it has {', '.join(names)}")
    return dd[split], dd[eval_split]


def _load_tables(src: Any, key: str, fields: list[str]) -> tuple[_Table, _Table | None, str]:
    """(train table, eval table or None, label for messages) of one source."""
    path = str(_get(src, "path"))
    try:
        fmt = resolve_format(path, str(_get(src, "format", "auto")))
    except ValueError as err:
        raise DataError(f"{key}.path={path}: {err}") from None
    local = expand(path)
    if fmt in ("json", "jsonl", "csv", "parquet"):
        train = _read_file(local, fmt, key, fields)
        eval_path = _get(src, "eval_path")
        if not eval_path:
            return train, None, str(local)
        eval_local = expand(eval_path)
        if not eval_local.is_file():
            raise DataError(f"{key}.eval_path={eval_path}: file not found; fix the path or remove eval_path")
        return train, _read_file(eval_local, fmt, key, fields), str(local)
    if fmt == "dschat":
        train_file, eval_file = dschat_files(local)  # type: ignore[misc]  # resolve_format checked it
        train = _read_file(train_file, "json", key, fields)
        if eval_file is None or _get(src, "eval_split", "auto") is None:
            return train, None, str(local)
        return train, _read_file(eval_file, "json", key, fields), str(local)
    if fmt == "arrow":
        import datasets

        try:
            loaded = datasets.load_from_disk(str(local))
        except (FileNotFoundError, ValueError, OSError) as err:
            raise DataError(f"{key}.path={path}: cannot load a save_to_disk directory: {err}") from None
        if isinstance(loaded, datasets.DatasetDict):
            train_ds, eval_ds = _pick_splits(loaded, src, key, str(local))
            return (
                _read_dataset(train_ds),
                _read_dataset(eval_ds) if eval_ds is not None else None,
                str(local),
            )
        return _read_dataset(loaded), None, str(local)
    # hub: only works online; errors are passed on in one line
    import datasets

    try:
        loaded = datasets.load_dataset(path, _get(src, "name"), revision=_get(src, "revision"))
    except Exception as err:  # the hub raises many types (connection, missing repo, auth)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{key}.path={path}: cannot load from the hub ({first}); offline? use a local copy") from None
    train_ds, eval_ds = _pick_splits(loaded, src, key, path)
    return _read_dataset(train_ds), _read_dataset(eval_ds) if eval_ds is not None else None, path


# ----------------------------------------------------------------------------------------------- rows


def _text(value: Any, key: str, field: str, label: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and math.isnan(value):  # pandas-style missing value
        return None
    if isinstance(value, (int, float, bool)):
        return str(value)
    raise DataError(
        f"{key}.{field}: {label} holds {type(value).__name__} values in that column, not text; "
        "point the field at a text column"
    )


def _rows(table: _Table, src: Any, key: str, label: str) -> tuple[Rows, int]:
    """Filtered rows and the number of rows dropped."""
    names = {"prompt": _get(src, "prompt_field", "prompt"), "chosen": _get(src, "chosen_field", "chosen")}
    for role, column in names.items():
        if column not in table.columns:
            shown = ", ".join(table.columns) if table.columns else "none (empty file?)"
            raise DataError(f"{key}.{role}_field={column}: column not found in {label}; its columns are: {shown}")
    rejected_col = _get(src, "rejected_field")
    prompts = [_text(v, key, "prompt_field", label) for v in table.get(names["prompt"])]
    chosens = [_text(v, key, "chosen_field", label) for v in table.get(names["chosen"])]
    if rejected_col and rejected_col in table.columns:
        rejecteds = [_text(v, key, "rejected_field", label) for v in table.get(rejected_col)]
    else:
        rejecteds = [None] * len(prompts)
    out = Rows()
    for p, c, r in zip(prompts, chosens, rejecteds, strict=True):
        if p is not None and c is not None and c.strip():
            out.prompt.append(p)
            out.chosen.append(c)
            out.rejected.append(r)
    return out, len(prompts) - len(out)


def load_source(src: Any, key: str) -> RawSource:
    fields = [f for f in (_get(src, "prompt_field"), _get(src, "chosen_field"), _get(src, "rejected_field")) if f]
    train_table, eval_table, label = _load_tables(src, key, fields)
    train, dropped = _rows(train_table, src, key, label)
    if not len(train):
        why = f"all {train_table.n} rows lack a prompt or an answer" if train_table.n else "it holds no rows"
        raise DataError(f"{key}: {label}: dataset is empty after filtering ({why})")
    eval_rows = None
    if eval_table is not None:
        eval_rows, eval_dropped = _rows(eval_table, src, key, f"{label} (eval)")
        dropped += eval_dropped
    if dropped:
        log.warning("%s: %d rows without a prompt or with a blank answer were dropped", key, dropped)
    return RawSource(key, train, eval_rows, dropped)


def synthetic_source(synthetic: Any) -> RawSource:
    from ds_exp.data.synthetic import generate

    train, eval_rows = generate(
        int(_get(synthetic, "num_train")), int(_get(synthetic, "num_eval")), int(_get(synthetic, "seed", 0))
    )

    def rows(items: list[dict[str, str]]) -> Rows:
        return Rows([r["prompt"] for r in items], [r["chosen"] for r in items], [r["rejected"] for r in items])

    return RawSource("data.synthetic", rows(train), rows(eval_rows) if eval_rows else None)
