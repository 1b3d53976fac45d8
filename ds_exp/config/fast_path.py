"""The fast path on GPUs (issue 32), decided from the config alone: Liger's kernels (model.liger_kernel), Liger's fused
linear cross-entropy (model.fused_loss) and compiled decoder layers (train.compile). Each is `auto` (on where it runs
and helps: a CUDA GPU with the package installed; off on CPUs, so every CPU run is the plain one), `true` (asked for:
a clear message where it cannot run) or `false`. The attention kernel has its own knob, model.attn_implementation
(auto: ds_exp/model/attention.py). Light: packages are looked for, never imported; the model layer applies what is
decided here (ds_exp/model/build.py, fused_loss.py, compile.py).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from ds_exp.config.long_context import logits_changed_after_head
from ds_exp.config.model_checks import model_settings
from ds_exp.config.schema import Config

AUTO = "auto"


def toggle(value: object) -> bool | None:
    """A fast-path knob's value: True / False, None for auto; ValueError for anything else."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == AUTO:
        return None
    if text in ("true", "false"):
        return text == "true"
    raise ValueError(value)


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def triton_interpreted() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1) runs Liger's fused loss on the host: slow, for tests on CPUs. Its
    RMSNorm and SwiGLU kernels do not run there (liger-kernel 0.8.5, triton 3.9)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class FastPath:
    """What this run uses, each knob decided."""

    liger_kernel: bool  # Liger's RMSNorm, SwiGLU and RoPE patched into the model
    fused_loss: bool  # the loss through Liger's fused linear cross-entropy: no full logits tensor
    compile: bool  # torch.compile of each decoder layer (regional compilation)


def decide(cfg: Config, accelerator: str, zero_stage: int) -> FastPath:
    """Each knob with auto decided (values validated before: fast_path_problems)."""
    cuda = accelerator == "cuda"
    liger = toggle(cfg.model.liger_kernel)
    fused = toggle(cfg.model.fused_loss)
    compiled = toggle(cfg.train.compile)
    return FastPath(
        liger_kernel=liger if liger is not None else cuda and liger_installed(),
        fused_loss=fused if fused is not None else cuda and liger_installed() and _logit_transform(cfg) is None,
        # ZeRO-3 gathers each submodule's parameters in hooks that run inside a layer's forward: each one would break
        # the compiled graph, so auto leaves ZeRO-3 eager (train.compile=true compiles it anyway)
        compile=compiled if compiled is not None else cuda and zero_stage < 3,
    )


def fast_path_problems(cfg: Config, accelerator: str) -> list[str]:
    """The knobs' values, and a knob set to true where it cannot run: one line each, naming the fix."""
    problems = []
    values = {
        "model.liger_kernel": cfg.model.liger_kernel,
        "model.fused_loss": cfg.model.fused_loss,
        "train.compile": cfg.train.compile,
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
        transform = _logit_transform(cfg)
        if transform is not None:
            problems.append(
                f"model.fused_loss=true: this model changes its logits after lm_head ({transform}), which the fused "
                "loss (computed from lm_head's weight) would skip; set model.fused_loss=false"
            )
    return problems


def _logit_transform(cfg: Config) -> str | None:
    return logits_changed_after_head(model_settings(cfg.model))
