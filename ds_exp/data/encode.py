"""Conversations -> unpadded input_ids and labels, through `datasets.map` with the fast tokenizer: offsets map the
template's label spans onto tokens exactly, for any tokenizer. A huge row can take minutes, so the Encoder touches a
progress file per batch and rank 0 says what is being tokenized while none moves."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pyarrow.compute as pc

from ds_exp.core.waits import announce_while
from ds_exp.data.sources import Rows
from ds_exp.data.templates import Span, render_chat, render_dschat, render_raw

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # labels that never count in the loss (torch cross_entropy's ignore_index)
# Below this many rows a process pool costs more than it saves: the fast tokenizer already uses threads.
PARALLEL_MIN_ROWS = 50_000
# Rows per map batch: up to 1000, fewer for long rows so that one batch holds about this many tokens (memory is
# bounded by a batch, not the data set: at data.max_seq_len=1M a batch is one row).
TOKENS_PER_BATCH = 2**20
COLUMNS = ("roles", "contents", "template")  # what the map reads from Rows


def end_of_conversation(eot: str | None, tokenizer: PreTrainedTokenizerBase) -> str:
    """The text appended after the last answer by raw and dschat: the configured token, else the eos."""
    return eot if eot is not None else (tokenizer.eos_token or "")


def label_ranges(offsets: Sequence[tuple[int, int]], spans: Sequence[Span], text_len: int) -> list[tuple[int, int]]:
    """Token ranges [lo, hi) starting inside a label span; a zero-width token (bos, eos) goes with the one before it."""
    n = len(offsets)
    if len(spans) == 1 and spans[0][1] >= text_len:  # one answer at the end (prompt/chosen rows): one scan
        start = spans[0][0]
        lo = next((j for j, (s, e) in enumerate(offsets) if s >= start and e > s), n)
        return [(lo, n)] if lo < n else []
    ranges: list[tuple[int, int]] = []
    i = 0
    for start, end in spans:
        while i < n and (offsets[i][1] <= offsets[i][0] or offsets[i][0] < start):
            i += 1
        if i == n or offsets[i][0] >= end:
            continue  # no token starts inside (an empty answer)
        lo = i
        if end >= text_len:  # the last span runs to the end of the text: every token after lo
            ranges.append((lo, n))
            break
        while i < n and (offsets[i][1] <= offsets[i][0] or offsets[i][0] < end):
            i += 1
        ranges.append((lo, i))
    return ranges


@dataclass
class Encoder:
    """The batched map function. A plain picklable object so `num_proc > 1` can ship it to workers."""

    tokenizer: PreTrainedTokenizerBase
    eot: str  # after the last answer of raw and dschat rows
    max_seq_len: int
    train_on_prompt: bool
    specials: tuple[str, ...] = ()  # the tokenizer's special tokens as text (templates.special_strings)
    progress_file: str | None = None  # touched after each batch (any process of the map): see the module docstring
    pairs: bool = False  # preference pairs: chosen_* and rejected_* columns (ds_exp/preference/)

    @property
    def columns(self) -> tuple[str, ...]:
        """What the map reads of Rows."""
        return (*COLUMNS, "rejected") if self.pairs else COLUMNS

    @property
    def token_columns(self) -> tuple[str, ...]:
        if self.pairs:
            return tuple(f"{side}_{k}" for side in ("chosen", "rejected") for k in ("input_ids", "labels"))
        return ("input_ids", "labels")

    def render(self, template: str, roles: Sequence[str], contents: Sequence[str]) -> tuple[str, list[Span]]:
        """(full text, label character spans) of one row."""
        if template == "raw":
            return render_raw(roles, contents, self.eot)
        if template == "dschat":
            return render_dschat(roles, contents, self.eot)
        return render_chat(self.tokenizer, roles, contents, self.specials)

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out = self.encode(batch["template"], batch["roles"], batch["contents"])
        if self.pairs:  # the same conversation twice, ending once on the chosen answer and once on the rejected one
            rejected = [[*c[:-1], r] for c, r in zip(batch["contents"], batch["rejected"], strict=True)]
            other = self.encode(batch["template"], batch["roles"], rejected)
            out = {
                **{f"chosen_{k}": out[k] for k in ("input_ids", "labels")},
                **{f"rejected_{k}": other[k] for k in ("input_ids", "labels")},
                "truncated": [a or b for a, b in zip(out["truncated"], other["truncated"], strict=True)],
                "keep": [a and b for a, b in zip(out["keep"], other["keep"], strict=True)],
            }
        if self.progress_file is not None:
            with contextlib.suppress(OSError):  # a sign of life only
                os.utime(self.progress_file)
        return out

    def encode(self, templates: list[str], roles: list[list[str]], contents: list[list[str]]) -> dict[str, list[Any]]:
        rendered = [self.render(*row) for row in zip(templates, roles, contents, strict=True)]
        names = ("input_ids", "labels", "truncated", "keep")
        out: dict[str, list[Any]] = {name: [None] * len(rendered) for name in names}
        # chat templates carry their own bos; DeepSpeed-Chat's text relies on the tokenizer adding it
        groups: dict[bool, list[int]] = {}
        for i, template in enumerate(templates):
            groups.setdefault(template != "chat_template", []).append(i)
        fast = getattr(self.tokenizer, "is_fast", False)
        for add_special, rows in groups.items():
            # one token past the limit tells truncated examples apart without tokenizing huge texts whole
            enc = self.tokenizer(
                [rendered[i][0] for i in rows],
                add_special_tokens=add_special,
                truncation=True,
                max_length=self.max_seq_len + 1,
                return_offsets_mapping=fast,
                return_attention_mask=False,
            )
            for k, i in enumerate(rows):
                ids = enc["input_ids"][k]
                text, spans = rendered[i]
                if self.train_on_prompt:
                    ranges = [(0, len(ids))]
                elif fast:
                    ranges = label_ranges(enc["offset_mapping"][k], spans, len(text))
                else:
                    ranges = self._slow_ranges(text, spans, len(ids), add_special)
                truncated = len(ids) > self.max_seq_len
                ids = list(ids[: self.max_seq_len])
                labels = [IGNORE_INDEX] * len(ids)
                for lo, hi in ranges:
                    labels[lo:hi] = ids[lo:hi]  # slices past the truncation point are empty
                out["input_ids"][i] = ids
                out["labels"][i] = labels
                out["truncated"][i] = truncated
                out["keep"][i] = labels.count(IGNORE_INDEX) < len(labels)
        return out

    def _slow_ranges(self, text: str, spans: list[Span], n: int, add_special: bool) -> list[tuple[int, int]]:
        """Slow tokenizers have no offsets: tokenize the text up to each span boundary (exact for most)."""

        def count(chars: int) -> int:
            return len(self.tokenizer(text[:chars], add_special_tokens=add_special)["input_ids"])

        return [(count(start), n if end >= len(text) else count(end)) for start, end in spans]


def rows_per_batch(max_seq_len: int) -> int:
    return max(1, min(1000, TOKENS_PER_BATCH // max(int(max_seq_len), 1)))


def pick_num_proc(num_proc: int | None, num_rows: int) -> int:
    if num_proc is not None:
        return max(1, min(num_proc, -(-num_rows // 1000)))  # no more processes than map batches
    if num_rows < PARALLEL_MIN_ROWS:
        return 1
    return max(1, min(4, os.cpu_count() or 1))


BAR_MIN_ROWS = 10_000  # a smaller set tokenizes in about a second: no bar (announce_while speaks after 10 s)


@contextlib.contextmanager
def without_bars(quiet: bool = True) -> Iterator[None]:
    """datasets' progress bars off for the while, when `quiet` (a bar that fills in a blink is noise)."""
    was_disabled = datasets.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if quiet and not was_disabled:
            datasets.enable_progress_bars()


def encode(
    rows: Rows, encoder: Encoder, *, num_proc: int | None, desc: str, work_dir: Path | None = None
) -> tuple[datasets.Dataset, dict[str, int]]:
    """A Dataset with int32 input_ids/labels and counts; with `work_dir` tokens stream to an Arrow file there."""
    features = datasets.Features(
        {
            **{name: datasets.List(datasets.Value("int32")) for name in encoder.token_columns},
            "truncated": datasets.Value("bool"),
            "keep": datasets.Value("bool"),
        }
    )
    raw = datasets.Dataset.from_dict({name: getattr(rows, name) for name in encoder.columns})
    procs = pick_num_proc(num_proc, len(raw))
    rows_at_once = rows_per_batch(encoder.max_seq_len)
    progress = Path(work_dir or tempfile.gettempdir()) / f".progress-{desc}-{os.getpid()}"
    progress.touch()
    encoder = replace(encoder, progress_file=str(progress))
    try:
        with (
            announce_while(
                f"tokenizing {desc} ({len(rows)} rows)",
                idle_s=_idle(progress),
                detail=functools.partial(_longest, rows),
            ),
            without_bars(len(rows) < BAR_MIN_ROWS),
        ):
            ds = raw.map(
                encoder,
                batched=True,
                batch_size=rows_at_once,
                writer_batch_size=rows_at_once,
                cache_file_name=str(work_dir / f"encoded-{desc}.arrow") if work_dir is not None else None,
                num_proc=procs if procs > 1 else None,
                remove_columns=list(encoder.columns),
                features=features,
                load_from_cache_file=False,
                new_fingerprint=f"ds_exp-encode-{desc}",  # skips hashing the tokenizer; our own cache keys the result
                desc=f"Tokenizing {desc}",
            )
    finally:
        progress.unlink(missing_ok=True)
    # counted on the Arrow columns (map's output has no indices mapping, so ds.data is its rows): iterating
    # ds["..."] formats one row at a time (seconds per 100k rows)
    truncated = int(pc.sum(ds.data.column("truncated")).as_py() or 0)
    keep = ds.data.column("keep").to_numpy()
    dropped = int(len(keep) - keep.sum())
    if dropped:
        ds = ds.select(np.flatnonzero(keep).tolist())
    ds = ds.remove_columns(["truncated", "keep"])
    return ds, {"truncated": truncated, "dropped": dropped}


def _idle(progress: Path) -> Callable[[], float]:
    """Seconds since the map last finished a batch (the progress file's time)."""

    def idle() -> float:
        try:
            return time.time() - progress.stat().st_mtime
        except OSError:
            return 0.0

    return idle


def _longest(rows: Rows) -> str:
    """What a notice says of the rows: the longest (counted only once a notice is due)."""
    chars = max((sum(map(len, contents)) for contents in rows.contents), default=0)
    return f"its longest row has {chars:,} characters, which the tokenizer reads whole before truncating"


def pack(ds: datasets.Dataset, max_seq_len: int, *, work_dir: Path | None = None) -> datasets.Dataset:
    """Greedily concatenate consecutive examples up to max_seq_len, labels kept, position_ids restarting per example."""
    features = datasets.Features({k: datasets.List(datasets.Value("int32")) for k in PACKED_COLUMNS})
    rows_at_once = rows_per_batch(max_seq_len)
    return ds.select_columns(["input_ids", "labels"]).map(
        Packer(max_seq_len, last_index=len(ds) - 1),
        batched=True,
        batch_size=rows_at_once,
        writer_batch_size=rows_at_once,
        with_indices=True,
        remove_columns=["input_ids", "labels"],
        features=features,
        cache_file_name=str(work_dir / "packed.arrow") if work_dir is not None else None,
        load_from_cache_file=False,
        new_fingerprint="ds_exp-pack",  # our own cache keys the result
        desc="Packing",
    )


PACKED_COLUMNS = ("input_ids", "labels", "position_ids")


class Packer:
    """The batched map function of `pack`: one process, in order (the row being filled spans batches)."""

    def __init__(self, max_seq_len: int, last_index: int) -> None:
        self.max_seq_len, self.last_index = max_seq_len, last_index
        self.ids: list[int] = []
        self.labels: list[int] = []
        self.positions: list[int] = []

    def __call__(self, batch: dict[str, list[list[int]]], indices: list[int]) -> dict[str, list[list[int]]]:
        out: dict[str, list[list[int]]] = {name: [] for name in PACKED_COLUMNS}
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
            if self.ids and len(self.ids) + len(ids) > self.max_seq_len:
                self._emit(out)
            self.ids += ids
            self.labels += labels
            self.positions += range(len(ids))
        if self.ids and indices and indices[-1] == self.last_index:
            self._emit(out)
        return out

    def _emit(self, out: dict[str, list[list[int]]]) -> None:
        out["input_ids"].append(self.ids)
        out["labels"].append(self.labels)
        out["position_ids"].append(self.positions)
        self.ids, self.labels, self.positions = [], [], []
