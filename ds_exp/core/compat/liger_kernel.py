"""liger-kernel's internals ds_exp relies on (0.8.5): its kernels patched into a built model."""

from __future__ import annotations

from typing import Any


def apply_liger_kernels(model: Any) -> bool:
    """Liger's Triton kernels (RMSNorm, SwiGLU, RoPE) patched into this model instance; False for a model family Liger
    has none for. Its cross-entropy patches stay off: the fused loss is ds_exp's (ds_exp/fast_path/fused_loss.py)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if getattr(model.config, "model_type", None) not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return False
    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)
    return True
