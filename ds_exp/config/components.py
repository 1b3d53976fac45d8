"""Components: the options users extend (optimizers, trackers), each one entry of a table that owns its facts, naming
its heavy builder by dotted path; its package (maybe an optional extra) is looked up, never imported."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar


@dataclass(frozen=True)
class Component:
    """What every component entry knows: its option's name, its builder, and what it needs installed."""

    name: str
    builder: str  # "package.module:attribute", imported only when the component is built
    packages: tuple[str, ...] = ()  # import names that must be installed (looked up, not imported)
    extra: str | None = None  # the pip extra of ds_exp that installs them (None: a core dependency or none)

    def load_builder(self) -> Callable[..., Any]:
        """The builder itself: imports its module (heavy callers only)."""
        module, _, attribute = self.builder.partition(":")
        target: Any = importlib.import_module(module)
        for part in attribute.split("."):
            target = getattr(target, part)
        return target

    def missing_package(self, key: str) -> str | None:
        """One line naming `key`, the missing package and how to install it; None when everything is there."""
        missing = [name for name in self.packages if importlib.util.find_spec(name) is None]
        if not missing:
            return None
        install = f'pip install "ds_exp[{self.extra}]"' if self.extra else f"pip install {' '.join(missing)}"
        return f"{key}={self.name} needs {', '.join(missing)}, which is not installed: {install}"


C = TypeVar("C", bound=Component)


def table(entries: Iterable[C]) -> dict[str, C]:
    """A component table keyed by name; two entries with one name are a mistake of ds_exp's, caught at import."""
    out: dict[str, C] = {}
    for entry in entries:
        if entry.name in out:
            raise ValueError(f"two components named {entry.name!r}")
        out[entry.name] = entry
    return out
