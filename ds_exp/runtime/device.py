"""The accelerator as the run itself sees it (asked of DeepSpeed, never during validation)."""

from __future__ import annotations

from deepspeed.accelerator import get_accelerator

from ds_exp.config.precision import decide_precision, supports_bf16
from ds_exp.config.schema import plain


def runtime_supports_bf16() -> bool:
    """Asks the live accelerator (imports deepspeed): only for the run itself, never for validation."""
    return bool(get_accelerator().is_bf16_supported())


def resolved_precision(dtype: object, accelerator: str) -> str:
    """decide_precision, asking the live accelerator when needed (the run itself, never validation)."""
    bf16 = supports_bf16(accelerator)
    if bf16 is None and plain(dtype) == "auto":
        bf16 = runtime_supports_bf16()
    precision = decide_precision(dtype, accelerator, bf16)
    assert precision is not None
    return precision
