"""Per-rank bytes of model states in a real DeepSpeed engine: `torchrun ... -m bench.memory_probe OUT_DIR OVERRIDES`.

Builds the engine as ds_exp's recipe (ds_exp.train.recipe.setup) does (init_distributed, load_tokenizer,
prepare_sft_data, the run's plan from ds_exp.config.plan.plan_run, build_model, build_engine), takes one optimizer
step on a real batch (the first micro batch of each rank, loss scaled as Trainer.train_step does) and writes
OUT_DIR/rank<R>.json.

Every count is the sum of `untyped_storage().nbytes()` over distinct storages (a flat buffer that many
parameters view is counted once, with its alignment padding; tied embeddings once). A storage is claimed by
the first category that finds it, in the order params, optimizer, gradients, buckets, so nothing is counted
twice and a "copy" that is really the same buffer shows up as 0 bytes.

* params (after the step): the storages behind `p.data` of every model parameter. ZeRO 1/2: the flat
  `bit16_groups_flat` buffer the parameters are views of (full size on every rank). ZeRO 3: `p.ds_tensor`
  (this rank's partition, views of `fp16_partitioned_groups_flat`, which is fp32 here despite its name) plus
  the full `p.data` of parameters still gathered after the step: the persistent ones below
  stage3_param_persistence_threshold, kept whole on every rank (reported apart as `persistent_bytes`).
* optimizer (after the step): every tensor in the torch AdamW state (`exp_avg`, `exp_avg_sq`, the scalar
  `step`) plus DeepSpeed's fp32 master copy: ZeRO 1/2 `single_partition_of_fp32_groups` (a clone of this
  rank's partition, kept even in fp32 training), ZeRO 3 `fp32_partitioned_groups_flat` (in fp32 training
  the very buffer that holds the parameter partition, hence 0 new bytes). ZeRO 0: the torch optimizer
  updates the model's own parameters, so there is no master copy.
* grads, sampled twice: (a) "end of backward": when autograd is done, right before the engine's final
  reduction call (`engine.allreduce_gradients`, wrapped); (b) "for step": after `engine.backward` returns,
  what is kept until `engine.step`. Tensors: `p.grad` of every parameter, the ZeRO optimizer's
  `averaged_gradients` (ZeRO 1: views of the full `p.grad` of every parameter that overlaps this rank's
  partition; ZeRO 2: views of `grads_in_partition`, sized the same way), `grads_in_partition` (ZeRO 2),
  `grad_partitions_flat_buffer` (ZeRO 3: this rank's gradient partition, allocated at start and kept) and
  the `.grad` of the fp32 master partitions (set only inside `step`).
* buckets: the gradient reduce buckets (`ipg_buckets[dtype].buffer`, reduce_bucket_size elements, two with
  overlap_comm at ZeRO 1/2) at the end of backward: communication buffers, not model states.

Transient buffers of the step itself (the flattened fp32 gradient partition a ZeRO optimizer builds for Adam,
ZeRO 3's all-gather buffers) are freed before the step returns and are not sampled.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.common import compose

CATEGORIES = ("params", "optimizer", "grads", "buckets")


class Ledger:
    """Distinct storages, each claimed by one category."""

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}

    def count(self, category: str, tensors: Any) -> int:
        import torch

        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in self.owner:
                continue
            self.owner[ptr] = category
            total += storage.nbytes()
        return total


def flat(obj: Any) -> list[Any]:
    """Tensors inside nested lists, tuples and dicts (averaged_gradients is a dict of lists)."""
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in flat(v)]
    if isinstance(obj, (list, tuple)):
        out = [t for v in obj for t in flat(v)]
        extra = getattr(obj, "flat_partition", None)  # GradPartitionBufferGroup keeps its flat buffer
        return [*out, extra] if extra is not None else out
    return [obj]


def zero_parts(engine: Any) -> tuple[Any, Any]:
    """(ZeRO optimizer or None, the torch optimizer that holds the Adam state)."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", None)
    return (opt, inner) if inner is not None else (None, opt)


def master_copies(zero: Any) -> list[Any]:
    if zero is None:
        return []
    return [*getattr(zero, "single_partition_of_fp32_groups", []), *getattr(zero, "fp32_partitioned_groups_flat", [])]


def grad_tensors(model: Any, zero: Any) -> list[Any]:
    tensors = [p.grad for p in model.parameters()]
    if zero is not None:
        tensors += flat(getattr(zero, "averaged_gradients", None) or {})
        tensors += [getattr(zero, "grads_in_partition", None), getattr(zero, "grad_partitions_flat_buffer", None)]
        tensors += [m.grad for m in master_copies(zero)]
    return tensors


def bucket_tensors(zero: Any) -> list[Any]:
    if zero is None:
        return []
    return [t for bucket in getattr(zero, "ipg_buckets", {}).values() for t in flat(bucket.buffer)]


def param_tensors(model: Any) -> tuple[list[Any], list[Any]]:
    """(tensors holding this rank's parameters, the full copies of gathered ZeRO-3 parameters)."""
    partitions = [p.ds_tensor for p in model.parameters() if hasattr(p, "ds_tensor")]
    if not partitions:
        return [p.data for p in model.parameters()], []
    return partitions, [p.data for p in model.parameters() if p.data.numel() > 0]


def grads_snapshot(model: Any, zero: Any) -> dict[str, int]:
    ledger = Ledger()
    # claim parameter storages first so a gradient view of them (none expected) cannot count as gradient
    partitions, gathered = param_tensors(model)
    ledger.count("params", [*partitions, *gathered])
    ledger.count("optimizer", master_copies(zero))
    return {
        "grads": ledger.count("grads", grad_tensors(model, zero)),
        "buckets": ledger.count("buckets", bucket_tensors(zero)),
    }


def state_snapshot(model: Any, zero: Any, inner: Any) -> dict[str, int]:
    ledger = Ledger()
    partitions, gathered = param_tensors(model)
    params = ledger.count("params", partitions)
    persistent = ledger.count("params", gathered)
    master = ledger.count("optimizer", master_copies(zero))
    adam = ledger.count("optimizer", [t for state in inner.state.values() for t in state.values()])
    return {
        "params": params + persistent,
        "persistent_bytes": persistent,
        "master_bytes": master,
        "master_tensors": len(master_copies(zero)),
        "adam_bytes": adam,
        "optimizer": master + adam,
        "grads_after_step": ledger.count("grads", grad_tensors(model, zero)),
    }


def prepare(cfg: Any, world: int, precision: str, out_dir: str) -> tuple[Any, Any, Any]:
    """(tokenizer, tokenized data, the run's plan) as the recipe makes them: ds_exp.config.plan.plan_run, whose steps
    and DeepSpeed batch count data-parallel ranks (world size / dist.sequence_parallel_size), not the world size."""
    from ds_exp.config.plan import plan_run
    from ds_exp.data.pipeline import prepare_sft_data
    from ds_exp.model.architecture import build_model_config, hidden_size_of
    from ds_exp.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model, cfg.data)
    data = prepare_sft_data(cfg.data, tokenizer, seed=cfg.train.seed)
    hidden = hidden_size_of(build_model_config(cfg.model, tokenizer))
    plan = plan_run(
        cfg, world_size=world, train_examples=len(data.train), hidden_size=hidden, precision=precision, run_dir=out_dir
    )
    return tokenizer, data, plan


def main() -> None:
    import torch
    import torch.distributed as dist

    from ds_exp.config.precision import detect_accelerator
    from ds_exp.launch.environment import detect_launch
    from ds_exp.model.build import build_model
    from ds_exp.model.engine import build_engine
    from ds_exp.runtime.device import resolved_precision
    from ds_exp.runtime.process_group import init_distributed
    from ds_exp.train.collate import make_collator
    from ds_exp.train.step import model_inputs, token_loss_sum

    out_dir, *overrides = sys.argv[1:]
    cfg = compose(*overrides)
    accelerator = detect_accelerator()
    init_distributed(cfg.dist, detect_launch(cfg.dist), accelerator)
    rank, world = dist.get_rank(), dist.get_world_size()
    precision = resolved_precision(cfg.precision.dtype, accelerator)
    tokenizer, data, plan = prepare(cfg, world, precision, out_dir)
    ds_config = plan.ds_config
    built = build_model(cfg, tokenizer, ds_config)
    model = built.model
    numel = sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in model.parameters())
    engine = build_engine(
        model,
        ds_config,
        optimizer_cfg=cfg.optimizer,
        scheduler_cfg=cfg.scheduler,
        config_file=cfg.deepspeed.config_file,
        total_steps=plan.total_steps,
        warmup_steps=plan.warmup_steps,
        accelerator=accelerator,
        mpu=built.mpu,
    ).deepspeed_engine
    zero, inner = zero_parts(engine)

    snapshots: dict[str, dict[str, int]] = {}
    reduce = engine.allreduce_gradients

    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        snapshots["end_of_backward"] = grads_snapshot(model, zero)
        return reduce(*args, **kwargs)

    engine.allreduce_gradients = allreduce_gradients  # instance attribute: the engine's backward looks it up
    micro = int(cfg.train.micro_batch_size)
    batch = make_collator(tokenizer)([data.train[i] for i in range(rank * micro, (rank + 1) * micro)])
    batch = {k: v.to(engine.device) for k, v in batch.items()}
    out = engine(**model_inputs(batch), use_cache=False)
    summed, count = token_loss_sum(out.logits, batch["labels"])
    tokens = count.detach().to(torch.float64)
    dist.all_reduce(tokens)
    engine.backward(summed * (world / float(tokens)))  # Trainer.train_step's scaling: mean over all tokens
    snapshots["for_step"] = grads_snapshot(model, zero)
    engine.step()
    state = state_snapshot(model, zero, inner)
    if "end_of_backward" not in snapshots:
        raise RuntimeError("engine.backward did not call allreduce_gradients: the grads sample is missing")

    result = {
        "rank": rank,
        "world_size": world,
        "zero_stage": int(ds_config["zero_optimization"]["stage"]),
        "precision": precision,
        "optimizer_class": type(engine.optimizer).__name__,
        "inner_optimizer": type(inner).__name__,
        "parameters": numel,
        "reduce_bucket_size": ds_config["zero_optimization"].get("reduce_bucket_size"),
        "persistence_threshold": ds_config["zero_optimization"].get("stage3_param_persistence_threshold"),
        "loss": float(summed.detach()) / float(count),
        **state,
        "grads_end_of_backward": snapshots["end_of_backward"]["grads"],
        "grads_for_step": snapshots["for_step"]["grads"],
        "buckets": snapshots["end_of_backward"]["buckets"],
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result, indent=2) + "\n")
    dist.barrier()


if __name__ == "__main__":
    main()
