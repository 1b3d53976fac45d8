"""Split arithmetic shared by the pipeline and `count_train_examples` (which must agree exactly). data.data_split is
DeepSpeed-Chat's (phases 1/2/3); ds_exp trains phase 1: "2,4,4" keeps 20%, as the data line says."""

from __future__ import annotations

import math
import re

from ds_exp.config.fields import FLOAT32_MAX

SPELLINGS = "data.data_split=10,0,0 (every row to SFT) or data.data_split=2,4,4 (DeepSpeed-Chat's three phases)"
_BRACKETS = re.compile(r"^\s*[\[(](.*)[\])]\s*$")


def split_parts(value: object) -> list[object]:
    """The proportions as written: "2,4,4", "2, 4, 4", "2 4 4", "[2,4,4]" (a quoted list), [2, 4, 4]."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return [value]
    text = str(value)
    inner = _BRACKETS.match(text)
    if inner:
        text = inner.group(1)
    parts = text.split(",") if "," in text else text.split()
    return [p.strip() for p in parts] or [text]


def parse_data_split(value: object) -> tuple[float, float, float]:
    """data.data_split in any spelling -> (phase 1, phase 2, phase 3); ValueError saying how to write it."""
    parts = split_parts(value)
    if len(parts) != 3:
        raise ValueError(f"expected 3 proportions (phases 1, 2, 3), got {len(parts)}; write {SPELLINGS}")
    numbers = []
    for part in parts:
        try:
            if isinstance(part, bool) or not isinstance(part, (str, int, float)):
                raise ValueError
            numbers.append(float(part))
        except ValueError:
            raise ValueError(f"proportions must be numbers, got {part!r}; write {SPELLINGS}") from None
    if any(not 0 <= v <= FLOAT32_MAX for v in numbers):  # nan and inf too; their sum must be finite
        raise ValueError(f"proportions must be numbers from 0 to {FLOAT32_MAX:.4g}; write {SPELLINGS}")
    if numbers[0] <= 0:
        raise ValueError(f"phase 1 (SFT) gets nothing: its proportion must be > 0; write {SPELLINGS}")
    return numbers[0], numbers[1], numbers[2]


def shown_split(split: tuple[float, float, float]) -> str:
    """(2.0, 4.0, 4.0) -> "2,4,4": the spelling that works on the command line."""
    return ",".join(f"{v:g}" for v in split)


def _round(x: float) -> int:
    return math.floor(x + 0.5 + 1e-9)  # half up, with slack for "0.2 * 5 = 0.99999"


def phase_bounds(n: int, split: tuple[float, float, float]) -> list[int]:
    """Cumulative boundaries [0, b1, b2, n]: phase k is rows [b(k-1), b(k)) of the seeded permutation."""
    total = sum(split)
    cum = 0.0
    bounds = [0]
    for value in split:
        cum += value
        bounds.append(min(n, _round(n * cum / total)))
    bounds[-1] = n
    return bounds


def phase1_count(n: int, split: tuple[float, float, float]) -> int:
    return phase_bounds(n, split)[1]


def eval_carve_count(n: int, fraction: float) -> int:
    """Rows held out for eval from n rows of a source that has no eval split: at least 1, never all."""
    if fraction <= 0 or n < 2:
        return 0
    return min(n - 1, max(1, _round(n * fraction)))


def left_for_later_phases(split: tuple[float, float, float], train_rows: int, eval_rows: int) -> str | None:
    """What the data line adds when the split leaves rows to phases 2 and 3; None when it leaves none."""
    if not train_rows and not eval_rows:
        return None
    left = f"{train_rows:,} train" + (f" and {eval_rows:,} eval" if eval_rows else "")
    return (
        f"data.data_split={shown_split(split)} gives SFT (phase 1) {split[0] / sum(split):.0%} of each source: {left} "
        "rows are left for phases 2 and 3 and not trained on (data.data_split=10,0,0 trains on every row)"
    )
