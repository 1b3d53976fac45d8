"""transformers' internals ds_exp relies on (5.23): a module's own weight initialization."""

from __future__ import annotations

from typing import Any


def reinit_module(model: Any, module: Any) -> None:
    """Run the model's own weight initialization on one module again (seeded by the caller); since transformers 5.0
    it skips tensors flagged `_is_hf_initialized`, so the flag is cleared first."""
    for param in module.parameters(recurse=False):
        param._is_hf_initialized = False
    model._init_weights(module)
