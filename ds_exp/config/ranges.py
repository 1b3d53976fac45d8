"""The numbers of the config: every number finite and within 64 bits, and every numeric key within the range its
field declares (fields.py, the one place a range is written). Light: no torch."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ds_exp.config.fields import CHECKED_BY, INT64_MAX, RANGE, Range, rule, walk_fields
from ds_exp.config.optimizers import OPTIMIZERS
from ds_exp.config.schema import Config, ZeroConfig


def _declared(kind: str) -> dict[str, Any]:
    """key -> rule of every field that declares one, across the schema and every optimizer's settings class."""
    found: dict[str, Any] = {}
    optimizers = (leaf for entry in OPTIMIZERS.values() for leaf in walk_fields(entry.settings, "optimizer."))
    for key, owner, f in [*walk_fields(Config), *optimizers]:  # the schema's own first
        if (declared := rule(owner, f.name, kind)) is not None:
            found.setdefault(key, declared)
    return found


# Every numeric key's range and every free-form key's check, read from its field
RANGES: dict[str, Range] = _declared(RANGE)
FREE_FORM: dict[str, str] = _declared(CHECKED_BY)
_ZERO_SIZES = tuple(key.removeprefix("zero.") for key, check in FREE_FORM.items() if "whole number" in check)
_SKIPPED = ("model.arch", "deepspeed")  # model.arch: checked with the architecture; a DeepSpeed file: DeepSpeed's


def number_problems(node: object, prefix: str = "") -> list[tuple[str, str]]:
    """(key, line) for every number of a settings tree (or its section `prefix`) not finite or beyond 64 bits."""
    problems: list[tuple[str, str]] = []

    def walk(value: object, key: str) -> None:
        if key in _SKIPPED:
            return
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        elif isinstance(value, (list, tuple)):
            if any(_non_finite(v) for v in value):
                problems.append((key, f"{key}={list(value)}: every number must be finite"))
            elif any(_beyond_64_bits(v) for v in value):
                problems.append((key, f"{key}={list(value)}: every number must be within 64 bits (|n| <= 2^63 - 1)"))
        elif _non_finite(value):
            problems.append((key, f"{key}={value}: must be a finite number"))
        elif _beyond_64_bits(value):
            problems.append((key, f"{key}={value}: too large; whole numbers go up to 2^63 - 1 ({INT64_MAX})"))

    walk(node, prefix.rstrip("."))
    return problems


def _non_finite(value: object) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _beyond_64_bits(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX


def lookup(node: object, key: str) -> Any:
    """The value of a dotted key below `node`; None where it has no such key (a setting of another optimizer)."""
    value: Any = node
    for part in key.split("."):
        value = getattr(value, part, None)
    return value


def range_problems(node: object, prefix: str = "") -> list[tuple[str, str]]:
    """(key, line) for every declared key below `node` (or its section `prefix`) whose value is outside its range."""
    problems: list[tuple[str, str]] = []
    for key, allowed in RANGES.items():
        if not key.startswith(prefix):
            continue
        value = lookup(node, key.removeprefix(prefix))
        items = value if isinstance(value, (list, tuple)) else [value]
        bad = [item for item in items if item is not None and allowed.problem(key, item)]
        if bad and isinstance(value, (list, tuple)):
            problems.append((key, f"{key}={list(value)}: each item {allowed.why(bad[0])}"))
        elif bad:
            problems.append((key, f"{key}={value}: {allowed.why(value)}"))
    return problems


def zero_value_problems(zero: ZeroConfig) -> list[tuple[str, str]]:
    """The zero.* values the schema types Any (a number or auto): what DeepSpeed's schema would refuse later."""
    problems: list[tuple[str, str]] = []
    overlap = zero.overlap_comm
    if overlap is not None and overlap not in (True, False, "auto"):
        problems.append(("zero.overlap_comm", f"zero.overlap_comm={overlap}: give true, false or auto"))
    for name in _ZERO_SIZES:
        value = getattr(zero, name)
        if value is None or value == "auto" or _whole_at_least_zero(value):
            continue
        problems.append((f"zero.{name}", f"zero.{name}={value}: give a whole number >= 0 (e.g. 5e8), or auto"))
    return problems


def _whole_at_least_zero(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return float(value).is_integer() and 0 <= value <= INT64_MAX
