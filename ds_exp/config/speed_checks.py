"""Features that need a package, a GPU or a name transformers knows, told before the model is loaded (not as an
ImportError or a NotImplementedError after it): model.attn_implementation (transformers' names, FlashAttention's
package and GPU, flex attention on the CPU) and Liger's kernels. Light: packages are found, never imported."""

from __future__ import annotations

import importlib.util
import re

from ds_exp.config.fast_path import fast_path_problems
from ds_exp.config.schema import Config

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
    TORCH_VARLEN,  # ds_exp's own: torch's variable-length kernel (ds_exp/model/attention.py)
)


def _attention_problems(attention: str | None) -> list[str]:
    """An attention implementation transformers has (its names, 4.50-5.24), ds_exp's auto, or a hub kernel."""
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


def speed_feature_problems(cfg: Config, accelerator: str) -> list[str]:
    """Features that need a package or a GPU: told here, not as an ImportError after the model is loaded."""
    attention = cfg.model.attn_implementation
    problems = _attention_problems(attention)
    if attention in ("flash_attention_2", "flash_attention_3"):
        package = "flash_attn" if attention == "flash_attention_2" else "flash_attn_interface"
        if accelerator != "cuda":
            problems.append(
                f"model.attn_implementation={attention} needs a CUDA GPU (this is {accelerator}); use "
                "model.attn_implementation=auto (FlashAttention where usable, else transformers' default)"
            )
        elif importlib.util.find_spec(package) is None:
            problems.append(
                f"model.attn_implementation={attention}: the {package} package is not installed "
                "(pip install flash-attn --no-build-isolation); or use model.attn_implementation=auto"
            )
    if attention == "flex_attention" and accelerator == "cpu":  # sequence parallel or not (issue 31 §9)
        problems.append(
            "model.attn_implementation=flex_attention cannot train on the CPU: torch's FlexAttention has no backward "
            "pass there (NotImplementedError in the first step); use model.attn_implementation=sdpa, or flex_attention "
            "on a GPU"
        )
    problems += fast_path_problems(cfg, accelerator)  # Liger's kernels, the fused loss, compile
    return problems
