"""torch's internals ds_exp relies on (2.4-2.13): where its JIT extensions build, their build lock, and torch.load."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def extension_build_dir(name: str) -> Path:
    """Where torch compiles the extension `name`. torch 2.4-2.13: `torch.utils.cpp_extension._get_build_directory`
    (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/<python>_<cuda tag>/<name>). If it changes, an op that
    loads from its cache gets a "compiling ..." notice."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def use_extension_baton(baton: type) -> None:
    """torch's JIT extension builds (every DeepSpeed op) take `baton` as their build lock instead of FileBaton.

    torch 2.13: `cpp_extension._jit_compile` looks `FileBaton` up in its module at each call and uses try_acquire,
    wait and release on `<build dir>/lock`. If that changes, a killed build's lock is waited on forever again,
    silently (tests/unit/test_waits.py's build-lock tests fail)."""
    import torch.utils.cpp_extension

    torch.utils.cpp_extension.FileBaton = baton  # type: ignore[misc,assignment]  # its subclass (runtime/build_lock.py)


@contextlib.contextmanager
def torch_load_weights_only(allowed: list[Any]) -> Iterator[None]:
    """While it lasts, every torch.load reads with weights_only=True, allowing only `allowed` types.

    DeepSpeed 0.19.8: `deepspeed.checkpoint.ds_to_universal` and the universal loader
    (`deepspeed.checkpoint.universal_checkpoint.load_hp_checkpoint_state`, the ZeRO optimizers'
    `_load_universal_checkpoint`) call torch.load(weights_only=False) themselves, not through the engine's
    checkpoint_engine (read_checkpoints_weights_only). If they start to, this is merely redundant; if they pass
    other arguments, weights_only=True still wins."""
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
    """Seconds this process spent in torch.compile (Dynamo's frames and the backward graphs it compiled). torch 2.13:
    `torch._dynamo.utils.calculate_time_spent()["total_wall_time"]`; if it goes, compile time reads 0."""
    import torch._dynamo.utils

    return float(torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0))
