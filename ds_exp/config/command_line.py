"""Commands ds_exp prints for a person to paste, each argument quoted for Hydra's override grammar and then for the
shell (tests/unit/test_console_lines.py parses them back). Light: hydra's parser only."""

from __future__ import annotations

import functools
import re
import shlex
from typing import TYPE_CHECKING

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

_SHELL_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./~-]+")  # what the shell takes as one word, unquoted
_IN_DOUBLE_QUOTES = re.compile(r'[^"$`\\!]*')  # what double quotes keep literally


@functools.cache
def _parser() -> OverridesParser:
    return OverridesParser.create()


def parse_override(arg: str) -> Override | None:
    """Hydra's own reading of one override (key, +/++/~, value with quotes undone), None where it fails."""
    try:
        return _parser().parse_overrides([arg])[0]
    except HydraException:
        return None


def override(key: str, value: object) -> str:
    """`key=value` as one argument a shell and then Hydra read back to `key` and exactly `value` (as text)."""
    text = str(value)
    arg = f"{key}={text}"
    if (
        parsed := parse_override(arg)
    ) is None or parsed.value() != text:  # Hydra would read a sweep, a list, a number, an interpolation...: quote it
        arg = f"{key}='{_escaped(text)}'"
    return shell_word(arg)


def _escaped(text: str) -> str:
    """`text` inside Hydra's single quotes: a quote escaped, backslashes before a quote or the closing one doubled."""
    return re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), text)


def shell_word(arg: str) -> str:
    """`arg` as one shell word: bare where it can be, in double quotes where they keep it literally, else shlex's."""
    if _SHELL_SAFE.fullmatch(arg):
        return arg
    if _IN_DOUBLE_QUOTES.fullmatch(arg):
        return f'"{arg}"'
    return shlex.quote(arg)


def command(program: str, *args: str) -> str:
    """`program` as typed, followed by `args`, each already built by `override` or `shell_word`."""
    return " ".join([program, *args])
