"""A training run: the recipe, session, workload, batches, loop, step, metric lines, evaluation and generation,
resuming, and the Python API (api). The package is that API too: made callable, it imports ds_exp.train.api on first
call, and stays a package for dotted names (`import ds_exp.train.recipe`, Hydra, mock). Layer 10, heavy. May import
every layer below it."""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, overrides: Sequence[str] = ()) -> dict[str, Any]:
        """Train one run of `overrides` in this process and return its summary.json (ds_exp/train/api.py)."""
        from ds_exp.train.api import train

        return train(overrides)


sys.modules[__name__].__class__ = _CallablePackage
