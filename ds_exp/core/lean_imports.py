"""What ds_exp keeps out of its processes' imports: all of mlflow, which `import deepspeed` would load for nothing.

DeepSpeed 0.16-0.19.8: `deepspeed/autotuning/autotuner.py` runs `try: import mlflow` at import time, and `import
deepspeed` imports it (runtime.config -> autotuning.config -> autotuning). mlflow-skinny is a dependency of ds_exp
(logger=mlflow), so every process that imported deepspeed paid for all of mlflow: 1.6 s of CPU on this 2-core
machine, 40% of `import deepspeed`, in every rank of every run. The autotuner uses mlflow only in DeepSpeed's own
autotuning (`deepspeed --autotuning`, which ds_exp never runs: its autotune is hydra/sweeper=autotune), so ds_exp
loads that one module with mlflow hidden: it records `has_mlflow = False` and nothing else changes. ds_exp's MLflow
tracker imports the real mlflow when a run logs to it. No private name is touched; if the module moves, the finder
sees no import of that name and DeepSpeed imports mlflow again (tests/unit/test_structure.py says so).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

AUTOTUNER = "deepspeed.autotuning.autotuner"


class _AutotunerWithoutMlflow(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds DeepSpeed's autotuner module as Python would, and runs it with `import mlflow` failing."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != AUTOTUNER or "mlflow" in sys.modules:  # imported already: nothing left to save
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # the import system's "not importable" entry
        try:
            self._loader.exec_module(module)
        finally:
            if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
                del sys.modules["mlflow"]


def keep_mlflow_out_of_deepspeed() -> None:
    """Install the finder (first in sys.meta_path, once). Imports nothing: safe for the light paths."""
    if not any(isinstance(finder, _AutotunerWithoutMlflow) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AutotunerWithoutMlflow())
