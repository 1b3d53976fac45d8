"""Which accelerator DeepSpeed will pick, told without importing torch or deepspeed."""

from __future__ import annotations

import glob
import os

from ds_exp.config.schema import plain


def detect_accelerator() -> str:
    """DS_ACCELERATOR when set (as DeepSpeed does), else cuda when an NVIDIA device node exists, else cpu."""
    forced = os.environ.get("DS_ACCELERATOR")
    if forced:
        return forced
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) == ""
    return "cuda" if not hidden and glob.glob("/dev/nvidia[0-9]*") else "cpu"


def supports_fp16(accelerator: str) -> bool:
    return accelerator not in ("cpu", "mps")


def supports_bf16(accelerator: str) -> bool | None:
    """True/False when known without torch; None when the device must be asked (CUDA compute capability)."""
    if accelerator == "cpu":
        return True  # DeepSpeed's CPU accelerator trains in bf16
    if accelerator == "cuda":
        return None
    return accelerator in ("xpu", "hpu", "npu")


def decide_precision(dtype: object, accelerator: str, bf16_supported: bool | None) -> str | None:
    """precision.dtype with "auto" decided: bf16 where supported, else fp32; None while that is unknown."""
    name = str(plain(dtype))
    if name != "auto":
        return name
    if bf16_supported is None:
        return None
    return "bf16" if bf16_supported else "fp32"
