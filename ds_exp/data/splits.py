"""Split arithmetic shared by the pipeline and `count_train_examples` (which must agree exactly)."""

from __future__ import annotations

import math


def parse_data_split(text: str) -> tuple[float, float, float]:
    """ "2,4,4" -> (2, 4, 4); raises ValueError saying what is wrong."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 3:
        raise ValueError(f"expected 3 comma-separated proportions (phases 1,2,3), got {len(parts)}")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError("proportions must be numbers") from None
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError("proportions must be finite and non-negative")
    if values[0] <= 0:
        raise ValueError("phase 1 (SFT) gets nothing: its proportion must be > 0")
    return values[0], values[1], values[2]


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
