"""LoRA through PEFT: which layers get adapters, and the wrapping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, get_peft_model

from ds_exp.core.errors import ConfigError


def lora_target_names(model: torch.nn.Module, module_name: str) -> list[str]:
    """Full names of the Linear layers inside the `lora.module_name` scope; an error lists candidates."""
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    targets = [name for name in linears if module_name in name]
    if not targets:
        scopes = sorted({name.rsplit(".", 1)[0] + "." for name in linears if "." in name})
        example = ", ".join(scopes[:8]) + (" ..." if len(scopes) > 8 else "")
        raise ConfigError(
            f"lora.module_name={module_name} matches no Linear layer of this model; Linear layers live under: "
            f"{example} (e.g. lora.module_name=layers.)"
        )
    return targets


@dataclass(frozen=True)
class LoraSpec:
    """What PEFT needs to wrap (and later rebuild for export) the same adapters."""

    dim: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    only_optimize: bool


def wrap_lora(model: Any, spec: LoraSpec) -> Any:
    """PEFT LoRA on exactly the listed Linear layers: W x + (alpha / r) B(A(dropout(x))), B = 0 at start."""
    peft_config = LoraConfig(
        r=spec.dim,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, peft_config)
    if not spec.only_optimize:
        for name, param in wrapped.named_parameters():
            if "lora_" not in name:
                param.requires_grad_(True)
    return wrapped
