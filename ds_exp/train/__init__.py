"""A training run: the recipe (setup -> resume -> train; the features at the named points of hooks), the session
that owns its lifecycle and failures, what setup builds (workload), batches (collate, sampler), the loop, one step
(step), metric lines (metrics, flops), evaluation and generation, where a run starts (resuming), the Python API (api).

The package is also that API (`from ds_exp import train; train(["lora.dim=64"])`): it must stay a package for dotted
names (`import ds_exp.train.recipe`, Hydra, mock), so it is made callable, importing ds_exp.train.api on first call.

Layer 10, heavy. May import every layer below it.
"""

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
