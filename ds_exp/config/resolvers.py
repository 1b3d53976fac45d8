"""OmegaConf resolvers used by conf/config.yaml to build the DeepSpeed config by interpolation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ds_exp.config.schema import plain

AUTO = "auto"

# transformers schedule -> the DeepSpeed scheduler that computes the same curve, for scheduler.owner=deepspeed.
# Values left "auto" are filled at run time (see ds_config.expected_values).
DEEPSPEED_SCHEDULERS: dict[str, dict[str, Any]] = {
    "linear": {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": AUTO,
            "warmup_min_lr": AUTO,
            "warmup_max_lr": AUTO,
            "warmup_num_steps": AUTO,
            "warmup_type": "linear",
        },
    },
    "cosine": {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": AUTO,
            "warmup_num_steps": AUTO,
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": 0.0,
            "warmup_type": "linear",
        },
    },
    "constant_with_warmup": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": AUTO,
            "warmup_max_lr": AUTO,
            "warmup_num_steps": AUTO,
            "warmup_type": "linear",
        },
    },
    "constant": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO, "warmup_num_steps": 1, "warmup_type": "linear"},
    },
}

DEEPSPEED_OPTIMIZER: dict[str, Any] = {
    "type": "AdamW",
    "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO},
}


# Blocks are returned as DictConfig: `OmegaConf.resolve` (used by `--cfg job --resolve`) cannot store a
# plain dict in a value node.
def deepspeed_optimizer(owner: object) -> DictConfig | None:
    return OmegaConf.create(DEEPSPEED_OPTIMIZER) if plain(owner) == "deepspeed" else None


def deepspeed_scheduler(owner: object, name: object) -> DictConfig | None:
    block = DEEPSPEED_SCHEDULERS.get(plain(name))  # an unsupported name is reported by validate()
    return OmegaConf.create(block) if block is not None and plain(owner) == "deepspeed" else None


def sequence_parallel_key(size: object) -> int | None:
    """DeepSpeed's top-level `sequence_parallel_size`, present only when sequence parallelism is on (null keys are
    left out): its batch check divides the world size by it."""
    return int(size) if isinstance(size, int) and size > 1 else None


def register_resolvers() -> None:
    resolvers: dict[str, Callable[..., DictConfig | int | None]] = {
        "ds_exp.deepspeed_optimizer": deepspeed_optimizer,
        "ds_exp.deepspeed_scheduler": deepspeed_scheduler,
        "ds_exp.sequence_parallel_key": sequence_parallel_key,
    }
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
