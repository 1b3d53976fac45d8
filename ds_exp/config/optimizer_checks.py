"""The optimizer's settings checked against the rest of the config before anything is built (its values, who builds
it, package, device, ZeRO stage, offload), every fact from its entry in optimizers.py. Light: no torch."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ds_exp.config.ds_config import MISSING, get_path, is_zero_stage, optimizer_needs
from ds_exp.config.fields import FLOAT32_MAX
from ds_exp.config.optimizer_settings import OptimizerConfig
from ds_exp.config.optimizers import OPTIMIZERS, OptimizerEntry, Owner, entry_of
from ds_exp.config.resolvers import AUTO
from ds_exp.config.schema import plain
from ds_exp.fast_path.settings import toggle

HOST_OFFLOAD = ("cpu", "nvme")
GROUP_KEYS = {"zero_optimization.reduce_scatter": "zero.reduce_scatter"}  # DeepSpeed key -> the setting that sets it
# how a message names a DeepSpeed value: (its path, its value, the ds_exp setting that sets it) -> "key=value"
Where = Callable[[str, object, str], str]


def _plain_where(path: str, value: object, group_key: str) -> str:
    return f"{group_key}={json.dumps(value) if isinstance(value, bool) else value}"


def settings_problems(opt: OptimizerConfig) -> list[str]:
    """The optimizer's own settings, each within its range already: one line per problem."""
    entry = OPTIMIZERS.get(str(opt.name))
    if entry is None:
        names = ", ".join(OPTIMIZERS)
        return [f"optimizer.name={opt.name}: no such optimizer; choose one with optimizer=<name>: {names}"]
    if type(opt) is not entry.settings:
        return [
            f"optimizer.name={opt.name} does not match the optimizer's settings ({type(opt).__name__}): choose the "
            f"optimizer with optimizer={opt.name}, which brings its settings, rather than setting optimizer.name"
        ]
    problems = opt.problems()  # what its ranges cannot say (ds_exp/config/optimizer_settings.py)
    owner = Owner(plain(opt.owner))
    if owner not in entry.owners:
        problems.append(_owner_problem(entry, owner))
    return problems + _learning_rate_problems(opt)


def _owner_problem(entry: OptimizerEntry, owner: Owner) -> str:
    if owner is Owner.ds_exp:
        return (
            f'optimizer.owner=ds_exp: optimizer={entry.name} is built by DeepSpeed (from a "{entry.deepspeed_type}" '
            "block of its config); set optimizer.owner=deepspeed"
        )
    return (
        f"optimizer.owner=deepspeed: DeepSpeed has no optimizer type for optimizer={entry.name}; set "
        "optimizer.owner=ds_exp"
    )


def _learning_rate_problems(opt: OptimizerConfig) -> list[str]:
    """Adam's first update divides lr by (1 - beta1), decay multiplies it: past float32's range the first step fails."""
    betas = list(getattr(opt, "betas", [0.0, 0.0]))
    if len(betas) != 2:  # said by its settings
        return []
    first_step = opt.lr / (1 - betas[0])
    decay = opt.lr * opt.weight_decay
    if first_step <= FLOAT32_MAX and decay <= FLOAT32_MAX:
        return []
    what = (
        f"{'AdamW' if opt.name == 'adamw' else opt.name}'s first step lr / (1 - beta1) = {first_step:.3g}"
        if first_step > FLOAT32_MAX
        else f"the weight decay factor lr x optimizer.weight_decay = {decay:.3g}"
    )
    return [
        f"optimizer.lr={opt.lr:g}: {what} is beyond the largest float32 number ({FLOAT32_MAX:.4g}), so no update can "
        "be computed; give a learning rate in the usual range (1e-5 to 1e-3 for fine-tuning; DeepSpeed-Chat uses 1e-3)"
    ]


def placement_problems(
    opt: OptimizerConfig,
    ds: dict[str, Any],
    accelerator: str,
    *,
    sequence_parallel_size: int,
    compile: object,
    where: Where = _plain_where,
) -> list[str]:
    """Where the optimizer runs, against the merged DeepSpeed config `ds` (`where` names a value from a user's file).
    Nothing for an optimizer the settings checks refuse."""
    entry = entry_of(opt)
    if entry is None:  # refused by settings_problems
        return []
    stage = get_path(ds, "zero_optimization.stage", None)
    offload = get_path(ds, "zero_optimization.offload_optimizer.device", "none")
    problems = []
    if entry.cuda_only and accelerator != "cuda":
        packages = ", ".join(entry.packages)
        absent = f" (and {packages} is not installed)" if entry.missing_package("optimizer") else ""
        return [
            f"optimizer={entry.name} needs a CUDA GPU and {packages}, and this is {accelerator}{absent}; use "
            "optimizer=adamw, or optimizer=lion for half of AdamW's optimizer memory"
        ]
    if (missing := entry.missing_package("optimizer")) is not None:
        problems.append(missing)
    if is_zero_stage(stage) and stage not in entry.zero_stages:
        allowed = " or ".join(f"zero=stage{s}" for s in entry.zero_stages)
        problems.append(
            f"optimizer={entry.name} at {where('zero_optimization.stage', stage, 'zero.stage')}: {entry.zero_note}; "
            f"use {allowed}, or another optimizer"
        )
    if offload in HOST_OFFLOAD and not entry.offload:
        what = where("zero_optimization.offload_optimizer.device", offload, "offload.optimizer")
        problems.append(
            f"optimizer={entry.name} with {what}: {entry.offload_note}; use offload=none, or optimizer=adamw"
        )
    if Owner(plain(opt.owner)) is Owner.ds_exp:
        problems += _impl_problems(opt, entry, offload, accelerator, where)
    elif entry.deepspeed_cuda and accelerator != "cuda" and offload not in HOST_OFFLOAD:
        problems.append(
            f"optimizer={entry.name} with optimizer.owner=deepspeed: DeepSpeed builds its CUDA kernel for it (or its "
            f"CPU one under optimizer offload), and this is {accelerator}; use optimizer.owner=ds_exp"
        )
    clipping = get_path(ds, "gradient_clipping", 0)
    if entry.clip_note and stage in (1, 2, 3) and isinstance(clipping, (int, float)) and clipping > 0:
        what = where("gradient_clipping", clipping, "train.gradient_clipping")
        problems.append(
            f"optimizer={entry.name} at ZeRO stage {stage} with {what}: {entry.clip_note}; set "
            "train.gradient_clipping=0, or use zero=stage0"
        )
    sp = sequence_parallel_size
    if stage == 3 and sp > 1 and entry.zero3_settings.get("zero_optimization.reduce_scatter", (True,))[0] is False:
        problems.append(
            f"optimizer={entry.name} at ZeRO stage 3 with dist.sequence_parallel_size={sp}: it needs "
            "zero.reduce_scatter off at ZeRO-3, where DeepSpeed 0.19.8 averages sequence-parallel gradients "
            "inexactly (ds_exp/core/compat/deepspeed.py); use zero=stage2 or lower with sequence parallelism"
        )
    if entry.compiled_update and accelerator == "cpu" and toggle(compile) is True:  # auto: off on CPUs
        problems.append(
            f"train.compile=true with optimizer={entry.name} on a CPU: ds_exp runs its update eagerly there "
            "(DeepSpeed's torch.compile'd update takes 10-30 s to compile per matrix shape on a CPU), which leaves "
            "torch.compile off for the run; set train.compile=false"
        )
    for path, value, current, why in optimizer_needs(opt, ds):
        if current not in (MISSING, None, AUTO) and current != value:
            setting = where(path, current, GROUP_KEYS.get(path, f"deepspeed.config.{path}"))
            problems.append(
                f"{setting}: {why}, so optimizer={entry.name} needs {json.dumps(value)} there; leave it unset (ds_exp "
                "sets it)"
            )
    return problems


def _impl_problems(
    opt: OptimizerConfig, entry: OptimizerEntry, offload: object, accelerator: str, where: Where
) -> list[str]:
    impl = str(plain(getattr(opt, "impl", "auto")))
    if not entry.impls or impl == "auto":
        return []
    if impl not in entry.impls:
        return [f"optimizer.impl={impl}: optimizer={entry.name} is built as {', '.join(entry.impls)} (or auto)"]
    how = entry.impls[impl]
    host = next(way for way in entry.impls.values() if way.host)
    host_name, host_impl = host.builder.rpartition(":")[2], next(n for n, w in entry.impls.items() if w.host)
    if offload in HOST_OFFLOAD and not how.host:
        what = where("zero_optimization.offload_optimizer.device", offload, "offload.optimizer")
        return [
            f"optimizer.impl={impl} with {what}: the offloaded optimizer step runs on the host with DeepSpeed's "
            f"{host_name}; use optimizer.impl=auto (or {host_impl})"
        ]
    if how.host and offload not in HOST_OFFLOAD and accelerator != "cpu":
        return [
            f"optimizer.impl={impl} updates parameters in host memory, but they live on the {accelerator} device: add "
            "offload=cpu (with zero=stage1 or higher) or use optimizer.impl=auto"
        ]
    if how.cuda and accelerator != "cuda":
        name = how.builder.rpartition(":")[2]
        return [f"optimizer.impl={impl}: {name} runs on CUDA GPUs and this is {accelerator}; use optimizer.impl=auto"]
    return []
