"""A training run, top to bottom: the recipe (recipe: setup -> resume -> train, the features at named points: hooks),
the session that owns its
lifecycle and failures (session), everything setup builds (workload), batches (collate, sampler), the loop
(loop), one optimizer step (step), metric lines (metrics, flops), evaluation and generation (evaluate, generate),
where a run starts (resuming: the checkpoint it continues, or step 0), the features' named points (hooks), and
the Python API that runs it in this process (api).

The package is also that API: `from ds_exp import train; summary = train(["lora.dim=64"])`. A function and a
package cannot both be `ds_exp.train`, and the package must stay one (`import ds_exp.train.recipe`, and every tool
that walks dotted names: Hydra's _target_, mock, monkeypatch), so the package is made callable: calling it calls
ds_exp.train.api.train, imported on the first call (importing one module of the package loads nothing more).

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
