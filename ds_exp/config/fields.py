"""A setting's rules beside its field: a number's range (`Range`), a free-form mapping's value (`Spec`), and `setting()`
declaring a field with them, for the checks, `--help` and the hostile-input generator. Light."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

INT64_MAX = 2**63 - 1  # torch, numpy and DeepSpeed's JSON take integers as 64-bit: a larger one overflows there
SEED_MAX = 2**32 - 1  # numpy's seeds (np.random.seed) are 32-bit, the narrowest library a seed reaches
MAX_TOKENS = 2**31 - 1  # tokens of a row: more than any model has positions
MAX_SYNTHETIC_ROWS = 10_000_000  # the embedded task is generated in this process, row by row
MAX_TIMEOUT_MINUTES = 525_600  # a year: torch's deadline (now + timeout, in nanoseconds) overflows near 1.5e8
FLOAT32_MAX = 3.4028234663852886e38  # the largest float32: a number past it is inf in every tensor it reaches


@dataclass(frozen=True)
class Range:
    """Where a number may lie: [low, high], either end open; an absent end is float32's (numbers reach tensors)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    fix: str = ""

    def holds(self, value: float) -> bool:
        return self._past_float32(value) is None and not (
            (self.low is not None and (value <= self.low if self.low_open else value < self.low))
            or (self.high is not None and (value >= self.high if self.high_open else value > self.high))
        )

    def said(self) -> str:
        if self.high is None:
            return f"must be {'>' if self.low_open else '>='} {_number(self.low)}"
        if self.low is None:
            return f"must be {'<' if self.high_open else '<='} {_number(self.high)}"
        if not (self.low_open or self.high_open) and float(self.high).is_integer() and float(self.low).is_integer():
            return f"must be from {_number(self.low)} to {_number(self.high)}"
        return (
            f"must be in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
            f"{')' if self.high_open else ']'}"
        )

    def why(self, value: float) -> str:
        """What is wrong with `value`, which the range does not hold (said after `KEY=VALUE: `)."""
        return self._past_float32(value) or f"{self.said()}{self.fix}"

    def _past_float32(self, value: float) -> str | None:
        if self.high is None and value > FLOAT32_MAX:
            return f"must be at most {FLOAT32_MAX:.4g}, the largest float32 number"
        if self.low is None and value < -FLOAT32_MAX:
            return f"must be at least {-FLOAT32_MAX:.4g}, the lowest float32 number"
        return None

    def problem(self, key: str, value: object) -> str | None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return None  # a type Hydra refused, or a non-finite number (said by number_problems)
        return None if self.holds(value) else f"{key}={value}: {self.why(value)}"


def _number(value: float | None) -> str:
    return str(int(value)) if value is not None and float(value).is_integer() else str(value)


def at_least(low: float, fix: str = "") -> Range:
    return Range(low=low, fix=fix)


def above(low: float, fix: str = "") -> Range:
    return Range(low=low, low_open=True, fix=fix)


@dataclass(frozen=True)
class Spec:
    """A free-form mapping's value: a number in its range, one of `choices`, or with `each` a list of numbers."""

    whole: bool = False
    range: Range | None = None
    choices: tuple[object, ...] = ()
    null: bool = False  # null allowed (the library's own default)
    auto: bool = False  # `auto`: ds_exp decides
    each: bool = False

    def problem(self, value: object) -> str | None:
        """What is wrong with `value` (said after `KEY=VALUE: `), or None."""
        if (value is None and self.null) or (value == "auto" and self.auto):
            return None
        if self.choices:
            words = [str(c).lower() if isinstance(c, bool) else str(c) for c in self.choices]
            return None if value in self.choices else f"give one of {', '.join(words)}"
        if self.each:
            items = value if isinstance(value, (list, tuple)) else []
            problems = [self._number_problem(item) for item in items] or ["give a non-empty list of numbers"]
            found = next((p for p in problems if p is not None), None)
            return None if found is None else f"each item: {found}" if items else found
        return self._number_problem(value)

    def _number_problem(self, value: object) -> str | None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or (self.whole and isinstance(value, float)):
            kind = "a whole number" if self.whole else "a number"
            return f"give {kind}{', auto' if self.auto else ''}{' or null' if self.null else ''}"
        if not math.isfinite(value):
            return "must be a finite number"
        allowed = self.range or Range()  # no range: float32's
        return None if allowed.holds(value) else allowed.why(value)


FRACTION = Range(0, 1, high_open=True)  # [0, 1)
SEED = Range(0, SEED_MAX)


RANGE = "ds_exp.range"  # a field's metadata key: its Range
CHECKED_BY = "ds_exp.checked_by"  # a free-form field's: the check that reads it (a dotted name and a few words)


def setting(
    default: Any = MISSING,
    *,
    range: Range | None = None,
    checked_by: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A settings dataclass field with its rule beside it: a number's `range`, or a free-form value's `checked_by`."""
    metadata: dict[str, Any] = {}
    if range is not None:
        metadata[RANGE] = range
    if checked_by is not None:
        metadata[CHECKED_BY] = checked_by
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def rule(cls: type, name: str, kind: str) -> Any:
    """The rule of field `name` of `cls` or of its nearest base declaring one (a changed default keeps the range)."""
    for klass in cls.__mro__:
        fields = getattr(klass, "__dataclass_fields__", {})
        if name in fields and kind in fields[name].metadata:
            return fields[name].metadata[kind]
    return None


def walk_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, type, dataclasses.Field[Any]]]:
    """(dotted key, owning class, field) of every leaf field of a settings dataclass, nested sections included."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        nested = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(nested) and not isinstance(nested, type):
            yield from walk_fields(type(nested), key + ".")
        else:
            yield key, cls, f
