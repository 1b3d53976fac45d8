"""Optimizer, LR scheduler and the DeepSpeed engine.

Who builds the optimizer and the scheduler follows the DeepSpeed config: an "optimizer" / "scheduler" block
there (optimizer.owner=deepspeed, or a user's config file) means DeepSpeed builds it; otherwise ds_exp does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

from omegaconf import DictConfig

from ds_exp.config.schema import plain

log = logging.getLogger(__name__)

# Schedules stepped with a metric rather than once per optimizer step: kept outside the engine.
METRIC_SCHEDULES = {"reduce_lr_on_plateau", "greedy"}


def parameter_groups(model: Any, weight_decay: float, no_decay: list[str]) -> list[dict[str, Any]]:
    """Two groups as DeepSpeed-Chat: no weight decay for biases and norm weights."""
    decay, plain = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (plain if any(key in name for key in no_decay) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(cfg: DictConfig, groups: list[dict[str, Any]], ds_config: dict[str, Any], accelerator: str) -> Any:
    """DeepSpeed's CPU Adam under optimizer offload, fused Adam on CUDA, torch AdamW otherwise."""
    import torch

    opt = cfg.optimizer
    kwargs = {"lr": opt.lr, "betas": tuple(opt.betas), "eps": opt.eps}
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload in ("cpu", "nvme"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    if accelerator == "cuda":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, adam_w_mode=True, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def build_scheduler(cfg: DictConfig, optimizer: Any, total_steps: int, warmup_steps: int) -> Any:
    from transformers import get_scheduler

    return get_scheduler(
        plain(cfg.scheduler.name),
        optimizer,
        num_warmup_steps=warmup_steps,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=dict(cfg.scheduler.kwargs) or None,
    )


@dataclass
class Engine:
    engine: Any  # deepspeed.DeepSpeedEngine
    metric_scheduler: Any | None  # stepped by the loop with a metric (plateau, greedy)


def build_engine(
    cfg: DictConfig, model: Any, ds_config: dict[str, Any], *, total_steps: int, warmup_steps: int, accelerator: str
) -> Engine:
    import deepspeed

    groups = parameter_groups(model, cfg.optimizer.weight_decay, list(cfg.optimizer.no_decay))
    optimizer = None if "optimizer" in ds_config else build_optimizer(cfg, groups, ds_config, accelerator)
    metric_schedule = plain(cfg.scheduler.name) in METRIC_SCHEDULES
    scheduler = None
    if "scheduler" not in ds_config and not metric_schedule:
        # a callable: DeepSpeed calls it with the optimizer, including one it built from the DeepSpeed config
        scheduler = partial(build_scheduler, cfg, total_steps=total_steps, warmup_steps=warmup_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=groups,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
    )
    metric_scheduler = None
    if "scheduler" not in ds_config and metric_schedule:
        metric_scheduler = build_scheduler(cfg, optimizer or engine.optimizer, total_steps, warmup_steps)
    return Engine(engine=engine, metric_scheduler=metric_scheduler)
