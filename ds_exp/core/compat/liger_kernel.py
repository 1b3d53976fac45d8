"""liger-kernel's internals ds_exp relies on (0.8.5): its kernels patched into a built model."""

from __future__ import annotations

from typing import Any


def apply_liger_kernels(model: Any) -> None:
    """Liger's Triton kernels (RMSNorm, SwiGLU, RoPE) patched into this model instance.

    liger-kernel 0.8.5: `liger_kernel.transformers._apply_liger_kernel_to_instance` (exported, underscore-named) patches
    a built model by its model_type. Its cross-entropy kernels stay off: ds_exp's loss is the exact sum over the
    global batch's label tokens, computed from the logits. If the function moves, model.liger_kernel=true fails
    at model build with an ImportError naming it."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)
