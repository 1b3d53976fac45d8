"""The accelerator as the run itself sees it (asked of DeepSpeed, never during validation)."""

from __future__ import annotations

from deepspeed.accelerator import get_accelerator

from ds_exp.config.precision import decide_precision, supports_bf16
from ds_exp.config.schema import plain


def resolved_precision(dtype: object, accelerator: str) -> str:
    """decide_precision, asking the live accelerator when needed (the run itself, never validation)."""
    bf16 = supports_bf16(accelerator)
    if bf16 is None and plain(dtype) == "auto":
        bf16 = bool(get_accelerator().is_bf16_supported())
    precision = decide_precision(dtype, accelerator, bf16)
    assert precision is not None
    return precision
