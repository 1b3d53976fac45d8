"""torch's internals ds_exp relies on (2.4-2.13): where its JIT extensions build, their build lock, and torch.load."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def extension_build_dir(name: str) -> Path:
    """Where torch compiles the extension `name` (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/...)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def use_extension_baton(baton: type) -> None:
    """torch's JIT extension builds take `baton` as their build lock instead of FileBaton (tests/unit/test_waits.py)."""
    import torch.utils.cpp_extension

    torch.utils.cpp_extension.FileBaton = baton  # type: ignore[misc,assignment]  # its subclass (runtime/build_lock.py)


@contextlib.contextmanager
def torch_load_weights_only(allowed: list[Any]) -> Iterator[None]:
    """While it lasts, every torch.load reads with weights_only=True, allowing only `allowed` types: DeepSpeed's
    universal converter and loader call torch.load themselves, not through the engine's checkpoint_engine."""
    import torch

    original = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        with torch.serialization.safe_globals(allowed):
            return original(*args, **{**kwargs, "weights_only": True})

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def compile_seconds() -> float:
    """Seconds this process spent in torch.compile (reads 0 if torch's private counter goes)."""
    import torch._dynamo.utils

    return float(torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0))
