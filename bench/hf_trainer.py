"""Hugging Face `Trainer` with ds_exp's DeepSpeed config, on ds_exp's model and micro batches, on CPU.

    torchrun --nproc_per_node 2 -m bench.hf_trainer --ds-config RUN/ds_config.json --steps S --out F.json -- OVERRIDES

The model (ds_exp.model.build_model), the tokenized train set and the collator are ds_exp's; the train set is
re-ordered (Workload.global_order) and read with `train_sampling_strategy="sequential"`, so that Accelerate's
sharding (batch i to rank i % world) hands each rank exactly the micro batches ds_exp's sampler gives it.
A TrainerCallback takes time.perf_counter() at on_step_begin / on_step_end of every optimizer step. The step
time reported is end-to-end (previous on_step_end, or on_train_begin, to this on_step_end): like ds_exp's
metric windows it includes fetching and collating the micro batches, which Trainer does before on_step_begin;
the begin-to-end time is written as well.

What Trainer + DeepSpeed needs on CPU (each found by running it; transformers 5.x, accelerate 1.x):
1. `use_cpu=True`, and with it `ddp_backend="gloo"`. Without use_cpu, TrainingArguments' DeepSpeed path builds
   Accelerate's PartialState with no backend; on a machine without CUDA `_prepare_backend` finds none, so
   Accelerate records backend None and a single process although DeepSpeed did start a 2-rank gloo group.
   Trainer then computes train_batch_size with world size 1 and refuses the config: "ValueError: Please
   correct the following DeepSpeed config values that mismatch TrainingArguments values: - ds
   train_batch_size=32 vs hf train_batch_size (calculated)=16". With train_batch_size "auto" it is filled
   with 16 and DeepSpeed fails instead: "AssertionError: Check batch related parameters. train_batch_size is
   not equal to micro_batch_per_gpu * gradient_acc_step * world_size 16 != 16 * 1 * 2". `ddp_backend` alone
   does nothing there (TrainingArguments passes it only on the CPU and plain-DDP paths). use_cpu=True makes
   the PartialState MULTI_CPU: a gloo process group of 2 (gloo named explicitly: Accelerate would pick mpi
   if this torch had it). DeepSpeed stays on: Trainer's Accelerator sets ACCELERATE_USE_DEEPSPEED itself
   because it gets the DeepSpeed plugin, and is not told cpu=True, so its state is DEEPSPEED and the model
   is wrapped in a DeepSpeedEngine (checked on every run: deepspeed_enabled / engine in the result).
2. `deepspeed.init_distributed(dist_backend="gloo")` after TrainingArguments and before building the model.
   On that path Accelerate calls torch.distributed.init_process_group itself, so DeepSpeed's comm layer is
   still uninitialized when ZeRO-3 builds the model inside deepspeed.zero.Init; its DeepSpeedConfig then
   catches the failing dist.get_world_size() and assumes 1: "AssertionError: Check batch related parameters.
   train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 32 != 16 * 1 * 1".
   (Stages 0-2 would pass without it: deepspeed.initialize initializes the comm layer later. On GPUs
   Accelerate's DeepSpeed path calls deepspeed.init_distributed itself.) It reuses the existing gloo group.
3. The DeepSpeed config is ds_exp's resolved one (no "auto" left). Trainer fills "auto" values but checks
   concrete ones against TrainingArguments, so these must agree with it: per_device_train_batch_size =
   train_micro_batch_size_per_gpu, gradient_accumulation_steps, max_grad_norm = gradient_clipping, and
   fp16 / bf16 = the config's enabled flags (both off: ds_exp's default precision is fp32). Trainer adds
   zero_allow_untested_optimizer=true to it (its own optimizer under ZeRO); nothing else changes.
4. `optim="adamw_torch"`: Trainer's default on torch >= 2.8 is "adamw_torch_fused" (a fused CPU kernel), not
   the per-parameter torch.optim.AdamW that ds_exp builds on CPU. Betas, eps, weight decay, LR, the schedule
   (lr_scheduler_type = scheduler.name, same warmup) and the seed come from ds_exp's config.
5. Kept as lean as the ds_exp run: no evaluation, no checkpoints, `logging_strategy="no"` (ds_exp writes its
   metric lines outside its timed windows; Trainer's logging would land inside the timed steps),
   report_to="none". dataloader_pin_memory=False (use_cpu sets it too; ds_exp does not pin).
Rank 0 writes the result; on failure it writes the error instead and exits non-zero.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from bench.workload import accelerator, load_workload, parse_args, write_json

RECOMMENDED = Path(__file__).with_name("hf_zero2_recommended.json")


def make_timer() -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """perf_counter at the start of training and at each optimizer step's begin and end."""

        def __init__(self) -> None:
            self.train_begin = 0.0
            self.begins: list[float] = []
            self.ends: list[float] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.train_begin = time.perf_counter()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.begins.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels are done: its time is on the clock
            self.ends.append(time.perf_counter())

        def step_times(self) -> list[float]:
            marks = [self.train_begin, *self.ends]
            return [b - a for a, b in itertools.pairwise(marks)]

        def inside_times(self) -> list[float]:
            return [e - b for b, e in zip(self.begins, self.ends, strict=False)]

    return StepTimer()


def train(args: Any) -> dict[str, Any]:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    from ds_exp.config.schema import plain

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # torchrun's
    work = load_workload(args, rank, world)
    cfg = work.cfg
    precision = {k: bool(work.ds_config.get(k, {}).get("enabled")) for k in ("fp16", "bf16")}
    on_gpu = accelerator() == "cuda"  # the GPU benchmark: nccl, and the Trainer's own default (fused) AdamW
    output_dir = args.out.parent / f"{args.out.stem}_trainer"  # stays empty: nothing is saved
    # --recommended: the Trainer as its documentation sets it up (its ZeRO-2 template, "auto" filled by Trainer)
    trainer_ds_config = json.loads(RECOMMENDED.read_text()) if args.recommended else work.ds_config
    targs = TrainingArguments(
        output_dir=str(output_dir),
        deepspeed=trainer_ds_config,
        use_cpu=not on_gpu,
        ddp_backend=None if on_gpu else "gloo",
        per_device_train_batch_size=work.micro,
        gradient_accumulation_steps=work.accum,
        max_steps=work.steps,
        max_grad_norm=float(cfg.train.gradient_clipping),
        learning_rate=float(cfg.optimizer.lr),
        adam_beta1=float(cfg.optimizer.betas[0]),
        adam_beta2=float(cfg.optimizer.betas[1]),
        adam_epsilon=float(cfg.optimizer.eps),
        weight_decay=float(cfg.optimizer.weight_decay),
        optim="adamw_torch_fused" if on_gpu else "adamw_torch",
        lr_scheduler_type=str(plain(cfg.scheduler.name)),
        warmup_steps=work.warmup,
        fp16=precision["fp16"],
        bf16=precision["bf16"],
        seed=int(cfg.train.seed),
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        dataloader_pin_memory=False,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
    )
    # Adjustment 2: Accelerate started torch.distributed itself; DeepSpeed's comm layer must wrap it before
    # zero.Init (ZeRO-3 model construction) reads the world size from it.
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", auto_mpi_discovery=False, verbose=False)
    built = work.build_model()  # kept alive: its HfDeepSpeedConfig is ZeRO-3's "on" switch for transformers
    timer = make_timer()
    trainer = Trainer(
        model=built.model,
        args=targs,
        train_dataset=work.data.train.select(work.global_order()),
        data_collator=work.collator,
        callbacks=[timer],
    )
    output = trainer.train()
    engine = trainer.model_wrapped
    return {
        "method": "hf_trainer",
        "world_size": world,
        "deepspeed_enabled": bool(trainer.is_deepspeed_enabled),
        "engine": type(engine).__name__,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "zero_stage": getattr(engine, "zero_optimization_stage", lambda: None)(),
        "optimizer": type(
            trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        ).__name__,
        "torch_threads": torch.get_num_threads(),
        "step_times_s": timer.step_times(),
        "step_begin_to_end_s": timer.inside_times(),
        "train_loss": output.training_loss,
        "tokens_per_step": work.tokens_per_step(),
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = train(args)
    except Exception as exc:
        if rank == 0:
            write_json(args.out, {"method": "hf_trainer", "error": f"{type(exc).__name__}: {exc}"})
        traceback.print_exc()
        raise SystemExit(1) from None
    if rank == 0:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
