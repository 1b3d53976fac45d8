"""LoRA's settings checked before anything is loaded: types, regular expressions, combinations, QLoRA's needs.
Which layers the names match is ds_exp/model/lora.py's to say. Light: no torch, no deepspeed."""

from __future__ import annotations

import importlib.util
import re

from ds_exp.config.schema import LoraConfig

ALL_LINEAR = "all-linear"
DEFAULT_SCOPE = "layers."
QUANTIZE = ("4bit", "8bit")
# set while lora.dim=0 they would do nothing: refused, not ignored
_NEEDS_LORA: dict[str, object] = {
    "target_modules": None,
    "modules_to_save": [],
    "use_dora": False,
    "use_rslora": False,
    "quantize": None,
}


def scope_of(lora: LoraConfig, model_scope: str | None = None) -> str | None:
    """The substring every adapted layer's name contains: lora.module_name, else `model_scope`, else `layers.`."""
    if lora.module_name is not None:
        return str(lora.module_name)
    if model_scope:
        return model_scope
    return DEFAULT_SCOPE if lora.target_modules is None else None


def _target_problems(targets: object) -> list[str]:
    if targets is None:
        return []
    if isinstance(targets, str):
        if not targets.strip():
            return ["lora.target_modules is empty: give layer names (e.g. [q_proj,v_proj]), all-linear, or null"]
        if targets.lower() == ALL_LINEAR:
            return []
        try:
            re.compile(targets)
        except re.error as err:
            return [
                f"lora.target_modules={targets!r} is not a valid regular expression ({err}); give a list of layer "
                "names instead, e.g. lora.target_modules=[q_proj,v_proj]"
            ]
        return []
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        return [
            f"lora.target_modules={targets!r}: give a non-empty list of layer names (e.g. [q_proj,v_proj]), a regular "
            "expression string, all-linear, or null"
        ]
    return []


def lora_problems(lora: LoraConfig, accelerator: str, *, name_or_path: str | None, zero_stage: int) -> list[str]:
    """One line per problem of lora.* that needs no model (QLoRA's: with the model it loads and the ZeRO stage)."""
    problems: list[str] = []
    if lora.dim <= 0:
        given = [key for key, off in _NEEDS_LORA.items() if getattr(lora, key) != off]
        if given:
            problems.append(
                f"lora.{given[0]} is set but LoRA is off (lora.dim={lora.dim}): set lora.dim (e.g. lora.dim=16) or "
                f"leave lora.{given[0]} unset"
            )
        return problems
    if lora.module_name is not None and not str(lora.module_name):
        problems.append(
            "lora.module_name is empty: name the scope of the adapted layers (e.g. lora.module_name=layers.), or set "
            "it to null and name the layers with lora.target_modules"
        )
    problems += _target_problems(lora.target_modules)
    saved = lora.modules_to_save
    if not all(isinstance(name, str) and name for name in saved):
        problems.append(f"lora.modules_to_save={saved!r}: give module names, e.g. [lm_head]")
    if lora.quantize is not None:
        problems += _quantize_problems(lora, accelerator, name_or_path, zero_stage)
    return problems


def _quantize_problems(lora: LoraConfig, accelerator: str, name_or_path: str | None, zero_stage: int) -> list[str]:
    """QLoRA: the frozen base loaded in 4 or 8 bits by bitsandbytes, which runs on CUDA GPUs."""
    key = f"lora.quantize={lora.quantize}"
    if lora.quantize not in QUANTIZE:
        return [f"{key}: give 4bit, 8bit or null (no quantization)"]
    if accelerator != "cuda":
        return [
            f"{key} (QLoRA) needs a CUDA GPU and bitsandbytes, and this is {accelerator}: set lora.quantize=null "
            "(plain LoRA) or run on a CUDA machine"
        ]
    if importlib.util.find_spec("bitsandbytes") is None:
        return [f"{key}: the bitsandbytes package is not installed: pip install bitsandbytes, or lora.quantize=null"]
    problems = []
    if name_or_path is None:
        problems.append(f"{key}: quantization loads a checkpoint; set model.name_or_path (the tiny model has none)")
    if not lora.only_optimize:
        problems.append(f"{key}: a quantized base cannot be trained; set lora.only_optimize=true")
    if zero_stage == 3:
        problems.append(f"{key}: not with ZeRO-3 (partitioning 4/8-bit weights is not supported here); use zero=stage2")
    return problems
