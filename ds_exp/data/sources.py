"""Reading every source kind into conversations. Rows are read into Python lists, not the `datasets` cache: the only
cache is ours, keyed on the file contents, and JSON is parsed by us so a bad row is reported by file and line."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from ds_exp.core.errors import DataError, first_line
from ds_exp.core.user_paths import special_file_problem
from ds_exp.data.conversations import ALPACA_COLUMNS, CHAT_COLUMNS, PAIR, Fields, Parsed, Rows, parse_rows
from ds_exp.data.formats import dschat_files, expand, resolve_format
from ds_exp.data.synthetic import generate
from ds_exp.data.textfiles import (
    StrictJSON,
    check_not_binary,
    is_gzip_name,
    note_bom,
    read_text,
    repeated_columns,
    repeated_key_error,
    starts_with_bom,
)

if TYPE_CHECKING:
    import datasets

    from ds_exp.config.schema import DataSource, SyntheticDataConfig

log = logging.getLogger(__name__)

EVAL_SPLIT_NAMES = ("eval", "validation", "valid", "test")
Where = Callable[[int], str]  # row index -> "file:line", "file: item i" or "file: row i"


@dataclass
class RawSource:
    key: str  # config key, e.g. data.sources[0]; starts every message about this source
    train: Rows
    eval: Rows | None  # None = the source has no eval split (eval_fraction is carved out instead)
    num_filtered: int = 0  # rows dropped for a missing prompt or a blank answer
    layout: str = "prompt_chosen"  # of the train split
    num_marked: int = 0  # rows that already carry DeepSpeed-Chat's " Human: ... Assistant:" markers
    first_marked: str | None = None  # where the first of them is
    template: str = ""  # resolved by the pipeline (templates.source_template)

    @property
    def num_rows(self) -> int:
        return len(self.train) + (len(self.eval) if self.eval is not None else 0)

    def set_template(self, template: str) -> None:
        self.template = template
        self.train.set_template(template)
        if self.eval is not None:
            self.eval.set_template(template)


def _json_records(path: Path, key: str) -> tuple[list[dict[str, Any]], Where]:
    """A JSON array of objects, an object of columns (or of one list of records), or JSON lines."""
    text = read_text(path, key, "JSON")
    if not text.strip():
        return [], lambda i: str(path)
    parser = StrictJSON()
    try:
        whole = parser.loads(text)
    except json.JSONDecodeError as err:
        # "Extra data" = a first document parsed and more follow: JSON lines. Otherwise the file is one
        # broken document and the decoder's position is the answer.
        if err.msg != "Extra data":
            raise DataError(f"{key}: {path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
        return _json_lines(text, path, key, parser)
    if isinstance(whole, list):
        bad = next((i for i, row in enumerate(whole) if not isinstance(row, dict)), None)
        if bad is not None:
            raise DataError(f"{key}: {path}: item {bad} of the JSON array is not an object")
        return _no_repeated_keys(parser, whole, _items_of(path), key, str(path)), _items_of(path)
    if not isinstance(whole, dict):
        raise DataError(f"{key}: {path}: expected JSON objects, got a {type(whole).__name__}")
    line = text[: len(text) - len(text.lstrip())].count("\n") + 1
    values = list(whole.values())
    single = len(values) == 1 and next(iter(whole)) in CHAT_COLUMNS  # one conversation, not {"data": [...]}
    if values and not single and all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
        if len(values) == 1 and all(isinstance(r, dict) for r in values[0]):
            records = _no_repeated_keys(parser, values[0], _items_of(path), key, f"{path}:{line}")
            return records, _items_of(path)  # {"data": [{...}, ...]}
        if parser.repeated:  # a column named twice, or a repeated key inside a cell
            raise repeated_key_error(key, f"{path}:{line}", parser.repeated[0][0])
        rows = [dict(zip(whole, row, strict=True)) for row in zip(*values, strict=True)]  # {"prompt": [...]}
        return rows, lambda i: f"{path}: row {i}"
    if parser.repeated:
        raise repeated_key_error(key, f"{path}:{line}", parser.repeated[0][0])
    return [whole], lambda i: f"{path}:{line}"  # a single record (or a JSON lines file of one line)


def _items_of(path: Path) -> Where:
    return lambda i: f"{path}: item {i}"


def _no_repeated_keys(parser: StrictJSON, items: list[Any], where: Where, key: str, outside: str) -> list[Any]:
    """`items`, after making sure none holds an object with a repeated key (searched only when there is one)."""
    for i, item in enumerate(items if parser.repeated else ()):
        repeated = parser.repeated_in(item)
        if repeated is not None:
            raise repeated_key_error(key, where(i), repeated)
    if parser.repeated:  # in the object around the items: {"data": [...], "data": [...]}
        raise repeated_key_error(key, outside, parser.repeated[0][0])
    return items


def _json_lines(text: str, path: Path, key: str, parser: StrictJSON) -> tuple[list[dict[str, Any]], Where]:
    records, linenos = [], []
    # split on newlines only: str.splitlines() also breaks at U+2028, U+0085, ... which JSON strings may hold
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = parser.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{key}: {path}:{lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{key}: {path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
        if parser.repeated:
            raise repeated_key_error(key, f"{path}:{lineno}", parser.repeated[0][0])
        records.append(row)
        linenos.append(lineno)
    return records, lambda i: f"{path}:{linenos[i]}"


def _columns_of_records(records: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for row in records:
        for k in row:
            seen.setdefault(k, None)
    return list(seen)


class _Table:
    """Column names plus a way to fetch one column as a list, whatever the storage."""

    def __init__(self, columns: list[str], getter: Callable[[str], list[Any]], n: int, where: Where) -> None:
        self.columns, self.get, self.n, self.where = columns, getter, n, where


def _read_file(path: Path, fmt: str, key: str, fields: list[str]) -> _Table:
    if (special := special_file_problem(key, path)) is not None:  # a FIFO found inside a directory, too
        raise DataError(special)
    if fmt in ("json", "jsonl"):
        records, where = _json_records(path, key)
        return _Table(_columns_of_records(records), lambda f: [r.get(f) for r in records], len(records), where)

    try:
        if fmt == "csv":
            check_not_binary(path, key, "CSV")
            if starts_with_bom(path):  # Arrow skips it; said once as for JSON
                note_bom(path)
            # answers that look like numbers stay text; missing columns in column_types are ignored
            opts = pacsv.ConvertOptions(column_types={f: pa.string() for f in fields})
            with pa.input_stream(str(path), compression="gzip" if is_gzip_name(path) else None) as stream:
                table = pacsv.read_csv(stream, convert_options=opts)
        else:
            table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError, EOFError) as err:
        raise DataError(f"{key}: {path}: cannot read as {fmt}: {first_line(err)}") from None
    repeated = repeated_columns(table.column_names)
    if repeated:
        what = f"columns {', '.join(repeated)} appear" if len(repeated) > 1 else f"column {repeated[0]} appears"
        raise DataError(
            f"{key}: {path}: the {what} more than once in the header; rename the columns so each name is unique"
        )
    return _Table(table.column_names, lambda f: table.column(f).to_pylist(), table.num_rows, _rows_of(str(path)))


def _rows_of(label: str) -> Where:
    return lambda i: f"{label}: row {i}"  # 0-based, as datasets' ds[i]


def _read_dataset(ds: datasets.Dataset, label: str) -> _Table:
    return _Table(list(ds.column_names), lambda f: ds[f], len(ds), _rows_of(label))


def _pick_splits(dd: datasets.DatasetDict, src: DataSource, key: str, label: str) -> tuple[_Table, _Table | None]:
    """(train, eval or None) tables out of a DatasetDict, following split / eval_split."""
    names = list(dd.keys())
    split = src.split
    if split not in dd:
        raise DataError(f"{key}.split={split}: {label} has no such split; it has {', '.join(names)}")
    eval_split = src.eval_split
    if eval_split == "auto":
        eval_split = next((n for n in EVAL_SPLIT_NAMES if n in dd and n != split), None)
    elif eval_split is not None and eval_split not in dd:
        raise DataError(f"{key}.eval_split={eval_split}: {label} has no such split; it has {', '.join(names)}")
    train = _read_dataset(dd[split], f"{label} [{split}]")
    if eval_split is None:
        return train, None
    fix = f"set {_hint(key)}.eval_split to a split with rows, or {_hint(key)}.eval_split=null to {_CARVE}"
    return train, _with_rows(
        _read_dataset(dd[eval_split], f"{label} [{eval_split}]"), key, f"{label} [{eval_split}]", fix
    )


_CARVE = "hold out data.eval_fraction of the train rows for eval instead"


def _hint(key: str) -> str:
    """A config key as a Hydra override spells it: data.sources[0] -> data.sources.0."""
    return key.replace("[", ".").replace("]", "")


def _with_rows(table: _Table, key: str, what: str, fix: str) -> _Table:
    """An eval split that holds no rows is refused with its fixes (not as a missing column of an empty file)."""
    if table.n == 0:
        raise DataError(f"{key}: {what} holds no eval rows; {fix}")
    return table


def _load_tables(src: DataSource, key: str, fields: list[str]) -> tuple[_Table, _Table | None, str]:
    """(train table, eval table or None, label for messages) of one source."""
    path = src.path
    try:
        fmt = resolve_format(path, src.format)
    except ValueError as err:
        raise DataError(f"{key}.path={path}: {err}") from None
    local = expand(path)
    if fmt in ("json", "jsonl", "csv", "parquet"):
        train = _read_file(local, fmt, key, fields)
        eval_path = src.eval_path
        if not eval_path:
            return train, None, str(local)
        eval_local = expand(eval_path)
        if not eval_local.is_file():
            raise DataError(f"{key}.eval_path={eval_path}: file not found; fix the path or remove eval_path")
        fix = f"add eval rows to it, or remove {_hint(key)}.eval_path to {_CARVE}"
        return train, _with_rows(_read_file(eval_local, fmt, key, fields), key, str(eval_local), fix), str(local)
    if fmt == "dschat":
        train_file, eval_file = dschat_files(local)  # type: ignore[misc]  # resolve_format checked it
        train = _read_file(train_file, "json", key, fields)
        if eval_file is None or src.eval_split is None:
            return train, None, str(local)
        fix = f"add eval rows to it, delete it, or set {_hint(key)}.eval_split=null to {_CARVE}"
        return train, _with_rows(_read_file(eval_file, "json", key, fields), key, str(eval_file), fix), str(local)
    import datasets  # only for save_to_disk directories and the hub: row checks of local files stay light

    if fmt == "arrow":
        try:
            loaded = datasets.load_from_disk(str(local))
        except (FileNotFoundError, ValueError, OSError) as err:
            raise DataError(f"{key}.path={path}: cannot load a save_to_disk directory: {err}") from None
        if isinstance(loaded, datasets.DatasetDict):
            return (*_pick_splits(loaded, src, key, str(local)), str(local))
        return _read_dataset(loaded, str(local)), None, str(local)
    # hub: only works online; errors are passed on in one line

    try:
        loaded = datasets.load_dataset(path, src.name, revision=src.revision)
    except Exception as err:  # the hub raises many types (connection, missing repo, auth)
        first = first_line(err)
        raise DataError(f"{key}.path={path}: cannot load from the hub ({first}); offline? use a local copy") from None
    return (*_pick_splits(loaded, src, key, path), path)


def _parse(table: _Table, fields: Fields, key: str, label: str, locate: bool = False) -> tuple[Parsed, str]:
    return parse_rows(table.columns, table.get, table.where, fields, key, label, locate=locate)


def source_fields(src: DataSource) -> Fields:
    return Fields(
        layout=src.layout or "auto",
        prompt=src.prompt_field,
        chosen=src.chosen_field,
        rejected=src.rejected_field,
        chosen_by_user=(src.layout or "auto") != "auto",
    )


def _text_columns(fields: Fields) -> list[str]:
    """Columns CSV reads as text: answers that look like numbers stay text."""
    return [f for f in (fields.prompt, fields.chosen, fields.rejected, *ALPACA_COLUMNS) if f]


def load_source(src: DataSource, key: str) -> RawSource:
    fields = source_fields(src)
    train_table, eval_table, label = _load_tables(src, key, _text_columns(fields))
    train, layout = _parse(train_table, fields, key, label)
    if not len(train.rows):
        why = f"all {train_table.n} rows lack a prompt or an answer" if train_table.n else "it holds no rows"
        raise DataError(f"{key}: {label}: dataset is empty after filtering ({why})")
    raw = RawSource(key, train.rows, None, train.dropped, layout, train.marked, train.first_marked)
    skipped = train.other_layout
    if eval_table is not None:
        # the eval split is read with the train split's layout: one source, one row format
        evals, _ = _parse(eval_table, replace(fields, layout=layout), key, f"{label} (eval)")
        raw.eval = evals.rows
        raw.num_filtered += evals.dropped
        raw.num_marked += evals.marked
        raw.first_marked = raw.first_marked or evals.first_marked
        skipped += evals.other_layout
    if raw.num_filtered:
        log.warning("%s: %d rows without a prompt or with a blank answer were dropped", key, raw.num_filtered)
    if skipped:
        log.warning("%s: %d rows in another layout than %s=%s were skipped", key, skipped, key + ".layout", layout)
    return raw


def located_rows(src: DataSource, key: str) -> Iterator[tuple[Rows, list[str]]]:
    """Each split's rows of a source with where each one is (read again: for a message or a row check)."""
    fields = source_fields(src)
    train_table, eval_table, label = _load_tables(src, key, _text_columns(fields))
    for table in (train_table, eval_table):
        if table is not None:
            parsed, fields.layout = _parse(table, fields, key, label, locate=True)
            yield parsed.rows, parsed.where or []


def find_row(src: DataSource, key: str, roles: list[str], contents: list[str]) -> str | None:
    """Where a row with these turns is in a source (read again: only for an error message), or None."""
    for rows, where in located_rows(src, key):
        for j, (r, c) in enumerate(zip(rows.roles, rows.contents, strict=True)):
            if r == roles and c == contents:
                return where[j]
    return None


def synthetic_source(synthetic: SyntheticDataConfig) -> RawSource:
    train, eval_rows = generate(int(synthetic.num_train), int(synthetic.num_eval), int(synthetic.seed))

    def rows(items: list[dict[str, str]]) -> Rows:
        return Rows(
            [PAIR] * len(items),
            [[r["prompt"], r["chosen"]] for r in items],
            [r["rejected"] for r in items],
            [""] * len(items),
        )

    # num_eval=0 means no eval set (an empty split), not "carve eval_fraction out of train" as for a file
    return RawSource("data.synthetic", rows(train), rows(eval_rows))
