"""The fast path's settings and each knob decided for the machine. Light: packages are looked for, never imported."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from ds_exp.config.model_checks import logits_changed_after_head, model_settings
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
    """Triton's interpreter (TRITON_INTERPRET=1) runs the fused loss on the host (tests); not Liger's other kernels."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class FastPath:
    """What this run uses, each knob decided."""

    liger_kernel: bool  # Liger's RMSNorm, SwiGLU and RoPE patched into the model
    fused_loss: bool  # the loss through Liger's fused linear cross-entropy: no full logits tensor
    compile: bool  # torch.compile of each decoder layer (regional compilation)


@dataclass(frozen=True)
class FastPathSettings:
    """The keys where users type them, and what deciding them reads of the rest."""

    attention: str | None = AUTO  # model.attn_implementation (null: transformers' default)
    liger_kernel: Any = AUTO  # model.liger_kernel
    fused_loss: Any = AUTO  # model.fused_loss
    compile: Any = AUTO  # train.compile
    sequence_parallel: int = 1  # dist.sequence_parallel_size: auto attention stays with flash-attn or sdpa under it
    logit_transform: str | None = None  # how the model changes its logits after lm_head (the fused loss would skip it)

    @classmethod
    def of(cls, cfg: Config) -> FastPathSettings:
        model = cfg.model
        transform = logits_changed_after_head(model_settings(cfg.model))
        sp = int(getattr(cfg.dist, "sequence_parallel_size", 1) or 1)
        return cls(model.attn_implementation, model.liger_kernel, model.fused_loss, cfg.train.compile, sp, transform)

    def decide(self, accelerator: str, zero_stage: int) -> FastPath:
        """Each knob with auto decided (values validated before: ds_exp.fast_path.checks)."""
        cuda = accelerator == "cuda"
        liger, fused, compiled = toggle(self.liger_kernel), toggle(self.fused_loss), toggle(self.compile)
        return FastPath(
            liger_kernel=liger if liger is not None else cuda and liger_installed(),
            fused_loss=fused if fused is not None else cuda and liger_installed() and self.logit_transform is None,
            # ZeRO-3 gathers each submodule's parameters in hooks that run inside a layer's forward: each one would
            # break the compiled graph, so auto leaves ZeRO-3 eager (train.compile=true compiles it anyway)
            compile=compiled if compiled is not None else cuda and zero_stage < 3,
        )
