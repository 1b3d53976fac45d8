"""What the fast path refuses before the model loads (light: packages found, never imported): an unknown attention,
a missing package or GPU, a knob asked for where it cannot run."""

from __future__ import annotations

import importlib.util
import re

from ds_exp.fast_path.settings import FastPathSettings, liger_installed, toggle, triton_interpreted

TORCH_VARLEN = "torch_varlen"

# transformers' attention implementations (ALL_ATTENTION_FUNCTIONS and eager; tests/unit/test_hostile_inputs.py
# checks them against the installed transformers)
ATTENTION_IMPLEMENTATIONS = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "paged|eager",
    TORCH_VARLEN,  # ds_exp's own: torch's variable-length kernel (ds_exp/fast_path/attention.py)
)


def attention_problems(attention: str | None, accelerator: str) -> list[str]:
    """An attention transformers has, ds_exp's auto, or a hub kernel; and what the one asked for needs."""
    if attention in ("flash_attention_2", "flash_attention_3"):
        package = "flash_attn" if attention == "flash_attention_2" else "flash_attn_interface"
        if accelerator != "cuda":
            return [
                f"model.attn_implementation={attention} needs a CUDA GPU (this is {accelerator}); use "
                "model.attn_implementation=auto (FlashAttention where usable, else transformers' default)"
            ]
        if importlib.util.find_spec(package) is None:
            return [
                f"model.attn_implementation={attention}: the {package} package is not installed "
                "(pip install flash-attn --no-build-isolation); or use model.attn_implementation=auto"
            ]
    if attention == "flex_attention" and accelerator == "cpu":  # sequence parallel or not (issue 31 §9)
        return [
            "model.attn_implementation=flex_attention cannot train on the CPU: torch's FlexAttention has no backward "
            "pass there (NotImplementedError in the first step); use model.attn_implementation=sdpa, or flex_attention "
            "on a GPU"
        ]
    if attention is None or attention == "auto" or attention in ATTENTION_IMPLEMENTATIONS:
        return []
    if re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.-]+)?", attention):  # a kernel from the hub, e.g. kernels-community/x
        if importlib.util.find_spec("kernels") is None:
            return [
                f"model.attn_implementation={attention} is a kernel from the hub, which transformers loads with the "
                "kernels package: pip install kernels, or use model.attn_implementation=auto"
            ]
        return []
    return [
        f"model.attn_implementation={attention}: transformers has no such attention; use one of auto, "
        f"{', '.join(ATTENTION_IMPLEMENTATIONS)} (or a hub kernel, org/name), or null for the model's default"
    ]


def fast_path_problems(settings: FastPathSettings, accelerator: str) -> list[str]:
    """The attention, the knobs' values, and a knob set to true where it cannot run: one line each, naming the fix."""
    problems = attention_problems(settings.attention, accelerator)
    values = {
        "model.liger_kernel": settings.liger_kernel,
        "model.fused_loss": settings.fused_loss,
        "train.compile": settings.compile,
    }
    asked = {}
    for key, value in values.items():
        try:
            asked[key] = toggle(value)
        except ValueError:
            problems.append(f"{key}={value}: expected auto, true or false")
    if asked.get("model.liger_kernel"):
        if accelerator != "cuda":
            problems.append(
                f"model.liger_kernel=true: Liger's kernels are Triton GPU kernels and this is {accelerator}; "
                "set model.liger_kernel=auto (on where they run) or false"
            )
        elif not liger_installed():
            problems.append(
                "model.liger_kernel=true: liger-kernel is not installed (pip install liger-kernel, or ds_exp's "
                "extra: pip install '.[gpu]'); or set model.liger_kernel=auto or false"
            )
    if asked.get("model.fused_loss"):
        if accelerator != "cuda" and not triton_interpreted():
            problems.append(
                f"model.fused_loss=true: Liger's fused linear cross-entropy is a Triton GPU kernel and this is "
                f"{accelerator}; set model.fused_loss=auto (on where it runs) or false"
            )
        elif not liger_installed():
            problems.append(
                "model.fused_loss=true: liger-kernel is not installed (pip install liger-kernel, or ds_exp's extra: "
                "pip install '.[gpu]'); or set model.fused_loss=auto or false"
            )
        if settings.logit_transform is not None:
            problems.append(
                f"model.fused_loss=true: this model changes its logits after lm_head ({settings.logit_transform}), "
                "which the fused loss (computed from lm_head's weight) would skip; set model.fused_loss=false"
            )
    return problems
