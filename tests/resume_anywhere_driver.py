"""Resume a ds_exp checkpoint with another world size, ZeRO stage or offload, through ds_exp.universal.

ds_exp's runner still refuses such resumes until ds_exp.universal is integrated; this stands in for it with
ds_exp's own builders (config, data, model, engine, sampler, loss) and the steps the integration plan names:
    python tests/resume_anywhere_driver.py --resume TAG_DIR --out result.json -- OVERRIDES...
(under torchrun for several ranks). Rank 0 writes the loss and LR of every step it trains, over all ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    from ds_exp.config.resolvers import register_resolvers
    from ds_exp.config.schema import register_configs, to_config
    from ds_exp.paths import conf_dir

    register_resolvers()
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=args.overrides))

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from ds_exp import universal
    from ds_exp.accelerator import detect_accelerator, resolved_precision
    from ds_exp.checkpoint import read_marker
    from ds_exp.config.ds_config import RunFacts, resolve_ds_config
    from ds_exp.data import ResumableDistributedSampler, load_tokenizer, make_collator, prepare_sft_data
    from ds_exp.distributed import detect_launch, init_distributed
    from ds_exp.engine import build_engine, parameter_groups
    from ds_exp.model import build_model, build_model_config, hidden_size_of
    from ds_exp.plan import steps_per_epoch, total_steps, warmup_steps
    from ds_exp.resume import settings_of
    from ds_exp.step import label_tokens, model_inputs, token_loss_sum

    accelerator = detect_accelerator()
    init_distributed(cfg.dist, detect_launch(cfg.dist), accelerator)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = load_tokenizer(cfg)
    model_config = build_model_config(cfg, tokenizer)
    data = prepare_sft_data(cfg, tokenizer)
    collator = make_collator(tokenizer, isolate_packed=bool(cfg.data.packing))
    total, per_epoch = (
        total_steps(len(data.train), cfg.train, world),
        steps_per_epoch(len(data.train), cfg.train, world),
    )
    warmup, precision = warmup_steps(cfg.scheduler, total), resolved_precision(cfg.precision.dtype, accelerator)
    facts = RunFacts(world, hidden_size_of(model_config), total, warmup, precision, str(args.out.parent))
    ds_config = resolve_ds_config(cfg, facts)

    # 1. decide before the engine exists: deepspeed.initialize reads checkpoint.load_universal
    current = settings_of(cfg, world, ds_config, precision)
    saved = read_marker(args.resume)["settings"]
    refused = universal.refused_changes(saved, current)
    if refused:
        raise SystemExit("refused:\n" + "\n".join(refused))
    use_universal = universal.needs_universal(saved, current)
    if use_universal:
        ds_config = universal.ds_config_for_load(ds_config)
    built = build_model(cfg, tokenizer, ds_config)
    # 2. convert (rank 0, once), with the names a stage-0 checkpoint's optimizer indices stand for
    if use_universal:
        groups = parameter_groups(built.model, cfg.optimizer.weight_decay, list(cfg.optimizer.no_decay))
        universal.convert(args.resume, rank=rank, param_names=universal.param_names(built.model, groups))
    engine = build_engine(cfg, built.model, ds_config, total_steps=total, warmup_steps=warmup, accelerator=accelerator)
    engine = engine.engine
    # 3. load, TrainState and RNG
    if use_universal:
        state = universal.load(engine, args.resume)["ds_exp"]
    else:
        from ds_exp.checkpoint import load

        state = load(engine, args.resume, rank=rank).as_dict()
    seed, saved_world = cfg.train.seed, saved["world_size"]
    exact_rng = universal.restore_rng(
        args.resume, rank=rank, world_size=world, saved_world_size=saved_world, seed=seed, step=state["step"]
    )

    micro, accum = cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps
    sampler = ResumableDistributedSampler(len(data.train), rank=rank, world_size=world, seed=cfg.train.seed)
    step, epoch, in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
    losses, lrs = [], []
    while step < total:
        sampler.set_epoch(epoch)
        sampler.set_start(in_epoch * micro * accum * world)  # samples consumed over all ranks
        loader = iter(DataLoader(data.train, batch_size=micro, sampler=sampler, collate_fn=collator, drop_last=True))
        while in_epoch < per_epoch and step < total:
            batches = [next(loader) for _ in range(accum)]
            sums = torch.tensor([float(sum(label_tokens(b) for b in batches)), 0.0], dtype=torch.float64)
            dist.all_reduce(sums)
            for batch in batches:  # as ds_exp's train_step: summed token losses over the global batch's tokens
                batch = {k: v.to(engine.device) for k, v in batch.items()}
                summed, _ = token_loss_sum(engine(**model_inputs(batch), use_cache=False).logits, batch["labels"])
                engine.backward(summed * (world * accum / float(sums[0])))
                engine.step()
                sums[1] += float(summed.detach())
            loss = torch.tensor([float(sums[1])], dtype=torch.float64)
            dist.all_reduce(loss)
            losses.append(float(loss) / float(sums[0]))
            lrs.append(float(engine.get_lr()[0]))  # after the step, as ds_exp's metric lines
            step, in_epoch = step + 1, in_epoch + 1
        if in_epoch >= per_epoch:
            epoch, in_epoch = epoch + 1, 0
    if rank == 0:
        result = {
            "losses": losses,
            "lrs": lrs,
            "first_step": state["step"] + 1,
            "universal": use_universal,
            "converted": universal.is_converted(args.resume),
            "exact_rng": exact_rng,
            "world_size": world,
        }
        args.out.write_text(json.dumps(result, indent=2))
    dist.barrier()


if __name__ == "__main__":
    main()
