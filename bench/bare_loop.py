"""The floor: a bare DeepSpeed loop over ds_exp's model and micro batches, nothing else per step.

    torchrun --nproc_per_node 2 -m bench.bare_loop --ds-config RUN/ds_config.json --steps S --out F.json -- OVERRIDES

OVERRIDES are those of the ds_exp run that wrote ds_config.json (composed with Hydra's compose API), so the
model (ds_exp.model.build_model, same seeded init), the data (prepare_sft_data, make_collator) and the order
of the micro batches (ResumableDistributedSampler, one DataLoader per epoch) are ds_exp's. The engine gets the
exact DeepSpeed config ds_exp resolved, and the optimizer ds_exp builds (ds_exp.model.engine.parameter_groups +
ds_exp.model.optimizers.build_optimizer: torch AdamW with two param groups on CPU) with ds_exp's LR schedule, so
the LR trajectory and hence the losses match too. Per step: fetch the micro batches, then forward (the model's own loss,
use_cache=False as ds_exp passes), engine.backward(loss), engine.step() for each. Each step is timed with
time.perf_counter (on CUDA after synchronizing); rank 0 writes the per-step times.
"""

from __future__ import annotations

import time
from functools import partial

from bench.workload import accelerator, init_distributed, load_workload, parse_args, write_json


def main() -> None:
    import deepspeed
    import torch

    from ds_exp.model.engine import build_scheduler, parameter_groups
    from ds_exp.model.optimizers import build_optimizer

    args = parse_args(__doc__.splitlines()[0])
    rank, world = init_distributed()
    work = load_workload(args, rank, world)
    cfg = work.cfg
    built = work.build_model()  # kept alive as ds_exp keeps it: its HfDeepSpeedConfig switches ZeRO-3 on
    model = built.model
    groups = parameter_groups(model, cfg.optimizer.weight_decay, list(cfg.optimizer.no_decay))
    device = accelerator()
    optimizer = build_optimizer(cfg.optimizer, groups, work.ds_config, device)
    scheduler = partial(build_scheduler, cfg.scheduler, total_steps=work.steps, warmup_steps=work.warmup)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups, optimizer=optimizer, lr_scheduler=scheduler, config=work.ds_config
    )

    step_times, losses = [], []
    batches = work.batches()
    for _ in range(work.steps):
        started = time.perf_counter()
        for batch in next(batches):
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch, use_cache=False).loss
            engine.backward(loss)
            engine.step()
        if device == "cuda":
            torch.cuda.synchronize()  # the step's kernels are done: its time is on the clock
        step_times.append(time.perf_counter() - started)
        losses.append(loss.detach())  # read after the loop: no .item() inside the timed step

    if rank == 0:
        write_json(
            args.out,
            {
                "method": "bare",
                "world_size": world,
                "zero_stage": work.ds_config["zero_optimization"]["stage"],
                "optimizer": type(optimizer).__name__,
                "torch_threads": torch.get_num_threads(),
                "step_times_s": step_times,
                "last_micro_batch_loss": [float(v) for v in losses],
                "tokens_per_step": work.tokens_per_step(),
            },
        )


if __name__ == "__main__":
    main()
