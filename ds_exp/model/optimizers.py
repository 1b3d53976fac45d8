"""The optimizer ds_exp builds from its entry in ds_exp/config/optimizers.py (the implementation optimizer.impl picks,
its DeepSpeed op compiled first); for one DeepSpeed builds (an "optimizer" block), what ds_exp does first."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ds_exp.config.optimizer_settings import OptimizerConfig
from ds_exp.config.optimizers import OPTIMIZERS, OptimizerEntry, entry_for_deepspeed_type
from ds_exp.runtime import ops

HOST_OFFLOAD = ("cpu", "nvme")


def offloaded(ds_config: dict[str, Any]) -> bool:
    return ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") in HOST_OFFLOAD


def optimizer_impl(opt: OptimizerConfig, ds_config: dict[str, Any], accelerator: str) -> str:
    """optimizer.impl with auto decided ("" for an optimizer built one way only)."""
    return OPTIMIZERS[opt.name].impl_for(opt, offload=offloaded(ds_config), accelerator=accelerator)


def build_optimizer(
    opt: OptimizerConfig, groups: list[dict[str, Any]], ds_config: dict[str, Any], accelerator: str
) -> torch.optim.Optimizer:
    entry = OPTIMIZERS[opt.name]
    how = entry.how(optimizer_impl(opt, ds_config, accelerator))
    if how.op is not None:
        ops.ensure_built(ops.OPS[how.op], announce=_is_rank0())
    builder = dataclasses.replace(entry, builder=how.builder).load_builder()
    optimizer: torch.optim.Optimizer = builder(groups, **entry.kwargs(opt), **how.kwargs)
    return optimizer


def deepspeed_entry(ds_config: dict[str, Any]) -> OptimizerEntry | None:
    """The entry of the optimizer DeepSpeed builds from the config's "optimizer" block (None: none of ours)."""
    block = ds_config.get("optimizer") or {}
    return entry_for_deepspeed_type(block.get("type", ""))


def deepspeed_op(ds_config: dict[str, Any]) -> ops.Op | None:
    """The op DeepSpeed compiles for the "optimizer" block: CPU Adam/Lion under offload, else FusedAdam/FusedLion."""
    entry = deepspeed_entry(ds_config)
    if entry is None or not entry.impls or (ds_config["optimizer"].get("params") or {}).get("torch_adam"):
        return None
    how = next((w for w in entry.impls.values() if w.host), None) if offloaded(ds_config) else None
    how = how or entry.impls.get("deepspeed_fused")
    return ops.OPS.get(how.op) if how is not None and how.op is not None else None


def prepare_deepspeed_optimizer(ds_config: dict[str, Any], accelerator: str) -> None:
    """The op DeepSpeed will compile, built first with a notice; on a CPU Muon runs eagerly (compiling is slow)."""
    op = deepspeed_op(ds_config)
    if op is not None:
        ops.ensure_built(op, announce=_is_rank0())
    entry = deepspeed_entry(ds_config)
    if entry is not None and entry.compiled_update and accelerator == "cpu":
        torch.compiler.set_stance("force_eager")


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
