"""Optimizer, LR scheduler and engine: DeepSpeed builds what its config has a block for, ds_exp the rest."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Any, Protocol

import deepspeed
import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from pydantic import ValidationError
from transformers import get_scheduler

from ds_exp.config.optimizer_settings import OptimizerConfig
from ds_exp.config.plan import scheduler_kwargs
from ds_exp.config.schema import SchedulerConfig, plain
from ds_exp.config.secrets import redact
from ds_exp.core import compat
from ds_exp.core.errors import ConfigError
from ds_exp.model.optimizers import build_optimizer, prepare_deepspeed_optimizer
from ds_exp.runtime.build_lock import guard_builds
from ds_exp.runtime.rank_logging import library_stdout

log = logging.getLogger(__name__)

# Schedules stepped with a metric rather than once per optimizer step: kept outside the engine.
METRIC_SCHEDULES = {"reduce_lr_on_plateau", "greedy"}


def parameter_groups(model: torch.nn.Module, weight_decay: float, no_decay: list[str]) -> list[dict[str, Any]]:
    """Two groups as DeepSpeed-Chat: no weight decay for biases and norm weights."""
    decay: list[torch.nn.Parameter] = []
    plain: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (plain if any(key in name for key in no_decay) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class MetricSchedule(Protocol):
    """A schedule the loop steps with a metric: ReduceLROnPlateau, or transformers' GreedyLR (not an LRScheduler)."""

    def step(self, metrics: float) -> None: ...


def build_scheduler(
    sched: SchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int
) -> Any:  # an LRScheduler stepped by DeepSpeed, or a MetricSchedule (METRIC_SCHEDULES); get_scheduler's unannotated
    return get_scheduler(
        plain(sched.name),
        optimizer,
        num_warmup_steps=warmup_steps,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=scheduler_kwargs(sched, total_steps, warmup_steps) or None,
    )


def check_deepspeed_config(ds_config: dict[str, Any], config_file: str | None) -> None:
    """DeepSpeed's schema reads zero_optimization now: a misspelt key is one message, not a pydantic traceback later."""
    try:
        DeepSpeedZeroConfig(**ds_config.get("zero_optimization", {}))
    except ValidationError as err:
        raise ConfigError(deepspeed_config_problems(err, "zero_optimization", config_file)) from None


def deepspeed_config_problems(err: ValidationError, block: str, config_file: str | None) -> list[str]:
    source = f"deepspeed.config_file={config_file}" if config_file else "the DeepSpeed config built from the groups"
    lines = [f"DeepSpeed rejects the {block} block of {source}:"]
    for problem in err.errors():
        key = ".".join(str(part) for part in (block, *problem["loc"]))
        if problem["type"] == "extra_forbidden":
            lines.append(f"- {key}: DeepSpeed has no such key (misspelt?); remove or fix it")
        else:
            lines.append(f"- {key}={problem.get('input')!r}: {problem['msg']}")
    return lines


@dataclass
class TrainingEngine:
    deepspeed_engine: DeepSpeedEngine
    metric_scheduler: MetricSchedule | None  # stepped by the loop with a metric (plateau, greedy)
    optimizer_name: str  # what updates the weights (describe_optimizer)


def build_engine(
    model: torch.nn.Module,
    ds_config: dict[str, Any],
    *,
    optimizer_cfg: OptimizerConfig,
    scheduler_cfg: SchedulerConfig,
    config_file: str | None,
    total_steps: int,
    warmup_steps: int,
    accelerator: str,
    mpu: ModuleType | None = None,
) -> TrainingEngine:
    """`config_file`: deepspeed.config_file (named in its problems); `mpu`: sequence parallelism's groups, or None."""
    groups = parameter_groups(model, optimizer_cfg.weight_decay, list(optimizer_cfg.no_decay))
    if "optimizer" in ds_config:  # DeepSpeed builds it inside initialize (its op compiled first, with a notice)
        optimizer = None
        prepare_deepspeed_optimizer(ds_config, accelerator)
    else:
        with library_stdout():  # DeepSpeed's CPU Adam / Lion print their settings from C++ on every rank
            optimizer = build_optimizer(optimizer_cfg, groups, ds_config, accelerator)
    name = describe_optimizer(optimizer, ds_config)
    log.info("optimizer: %s", name)
    metric_schedule = plain(scheduler_cfg.name) in METRIC_SCHEDULES
    scheduler = None
    if "scheduler" not in ds_config and not metric_schedule:
        # a callable: DeepSpeed calls it with the optimizer, including one it built from the DeepSpeed config
        scheduler = partial(build_scheduler, scheduler_cfg, total_steps=total_steps, warmup_steps=warmup_steps)
    guard_builds()  # an op DeepSpeed compiles inside initialize (NVMe's async I/O, ...) takes ds_exp's build lock
    try:
        with library_stdout():  # what DeepSpeed prints while it builds the engine (its optimizer's notices)
            engine, _, _, _ = deepspeed.initialize(
                model=model,
                model_parameters=groups,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                config=ds_config,
                mpu=mpu,
            )
    except ValidationError as err:  # another block than zero_optimization (checked before the model was built)
        raise ConfigError(deepspeed_config_problems(err, err.title, config_file)) from None
    # DeepSpeed saves engine.config into every checkpoint file (ds_config=...); its monitors (comet's api_key)
    # were built from it already
    engine.config = redact(engine.config)
    compat.keep_fp32_grad_norm(engine)  # grad_norm in the metric lines at ZeRO stage 0 in fp32 as well
    metric_scheduler = None
    if "scheduler" not in ds_config and metric_schedule:
        schedule_of = optimizer or engine.optimizer
        metric_scheduler = build_metric_scheduler(scheduler_cfg, schedule_of, total_steps, warmup_steps)
    return TrainingEngine(deepspeed_engine=engine, metric_scheduler=metric_scheduler, optimizer_name=name)


def release_engine(engine: DeepSpeedEngine) -> None:
    """Let a finished run's engine go (for a multirun's next job); best effort: never hides how the run ended."""
    try:
        if dist.is_initialized():  # DeepSpeed's destroy asks for the rank
            with library_stdout():
                engine.destroy()
        compat.forget_zero3_module(engine.module)
    except Exception as err:  # e.g. a CUDA error that ended the run comes back at synchronize
        log.debug("releasing the DeepSpeed engine: %s", err)
    torch.compiler.set_stance("default")  # a CPU Muon run's eager stance (ds_exp/model/optimizers.py)
    gc.collect()


def describe_optimizer(optimizer: torch.optim.Optimizer | None, ds_config: dict[str, Any]) -> str:
    """What updates the weights, for the log and summary.json: e.g. "AdamW (fused)", "DeepSpeedCPUAdam", "SGD"."""
    if optimizer is None:
        return f"{ds_config['optimizer'].get('type')} (built by DeepSpeed from the config's optimizer block)"
    fused = any(group.get("fused") for group in optimizer.param_groups)
    return type(optimizer).__name__ + (" (fused)" if fused else "")


def lr_at(trajectory: dict, step: int) -> float | None:
    """The learning rate of the step after `step` under `trajectory` (None for DeepSpeed's or a metric's schedule)."""
    if trajectory.get("scheduler_owner") != "ds_exp" or trajectory["scheduler"] in ("reduce_lr_on_plateau", "greedy"):
        return None
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=trajectory["lr"])
    schedule = get_scheduler(
        trajectory["scheduler"],
        optimizer,
        num_warmup_steps=trajectory["warmup_steps"],
        num_training_steps=trajectory["total_steps"],
        scheduler_specific_kwargs=trajectory["scheduler_kwargs"] or None,
    )
    return float(trajectory["lr"] * schedule.lr_lambdas[0](step))


build_metric_scheduler = build_scheduler  # the loop steps it with a metric (plateau, greedy)
