"""The flags of ds_exp's commands, read alike (issue 31 §2): a refusal is one line naming the flag and the fix; the
types refuse nan, inf, numbers past 64 bits or the range, and impossible paths."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from ds_exp.config.fields import INT64_MAX, SEED_MAX, Range
from ds_exp.config.shapes import path_too_long


class FlagParser(argparse.ArgumentParser):
    """argparse, with its errors said in one line: `ds_exp: error: <what> (see <prog> --help)`, exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"ds_exp: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def whole(low: int | None = None, high: int | None = None, fix: str = "") -> Callable[[str], int]:
    """A whole number within [low, high] (64 bits at most)."""
    allowed = Range(low, INT64_MAX if high is None else high, fix=fix)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not allowed.holds(value):
            raise argparse.ArgumentTypeError(f"{value} {allowed.why(value)}")
        return value

    parse.__name__ = "whole number"  # argparse names the type by it in its messages
    return parse


ANY_NUMBER = Range()  # float32's range: a flag's number reaches a tensor


def number(allowed: Range = ANY_NUMBER) -> Callable[[str], float]:
    """A finite number within `allowed` (float32's range when not given)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if not allowed.holds(value):
            raise argparse.ArgumentTypeError(f"{value:g} {allowed.why(value)}")
        return value

    parse.__name__ = "number"
    return parse


SEED = whole(0, SEED_MAX)


def path_text(text: str) -> str:
    """A path given as it was typed, refused when no file system can hold it (a name over 255 bytes)."""
    problem = path_too_long(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def path(text: str) -> Path:
    return Path(path_text(text))


path_text.__name__ = path.__name__ = "path"
