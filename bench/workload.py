"""ds_exp's training workload outside ds_exp's loop, for the bare DeepSpeed loop and the Hugging Face Trainer.

Everything comes from ds_exp's own builders (config composition, tokenizer, tokenized data, collator, model,
sampler), so the three ways of training in bench/step_time.py see the same model, the same weights and the same
micro batches in the same order. Run inside a torchrun rank (torch / deepspeed are imported lazily).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def compose(overrides: Sequence[str]) -> Any:
    """The config a `python -m ds_exp OVERRIDES` run sees, via Hydra's compose API (as tests/conftest.py does).
    hydra.* overrides only steer ds_exp's run directory and are dropped here."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ds_exp.config.paths import conf_dir
    from ds_exp.config.resolvers import register_resolvers
    from ds_exp.config.schema import register_configs, to_config

    register_resolvers()
    register_configs()
    kept = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return to_config(hydra_compose(config_name="config", overrides=kept))


def parse_args(description: str) -> argparse.Namespace:
    """The command line shared by bare_loop.py and hf_trainer.py: `--ds-config F --steps S --out F -- OVERRIDES`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ds-config", required=True, type=Path, help="ds_config.json written by the ds_exp run")
    parser.add_argument("--steps", required=True, type=int, help="optimizer steps to time")
    parser.add_argument("--out", required=True, type=Path, help="JSON result (written by rank 0)")
    parser.add_argument(
        "--recommended",
        action="store_true",
        help='hf_trainer only: Hugging Face\'s own recommended settings (its ZeRO-2 template with "auto" values, '
        "bf16 when the GPU has it, its default fused AdamW) instead of ds_exp's resolved config",
    )
    parser.add_argument("overrides", nargs="*", help="the ds_exp overrides of the run being compared")
    return parser.parse_args()


@dataclass
class Workload:
    cfg: Any
    tokenizer: Any
    data: Any  # ds_exp.data.SFTData
    collator: Any
    ds_config: dict[str, Any]
    rank: int
    world: int
    steps: int

    @property
    def micro(self) -> int:
        return int(self.cfg.train.micro_batch_size)

    @property
    def accum(self) -> int:
        return int(self.cfg.train.gradient_accumulation_steps)

    @property
    def steps_per_epoch(self) -> int:
        from ds_exp.config.plan import steps_per_epoch

        return steps_per_epoch(len(self.data.train), self.cfg.train, self.world)

    @property
    def warmup(self) -> int:
        from ds_exp.config.plan import warmup_steps

        return warmup_steps(self.cfg.scheduler, self.steps)

    def build_model(self) -> Any:
        """ds_exp.model.build_model: same init (seeded by module name), ZeRO-3 built inside zero.Init."""
        from ds_exp.model.build import build_model

        return build_model(self.cfg, self.tokenizer, self.ds_config)

    def sampler(self, rank: int) -> Any:
        from ds_exp.train.sampler import ResumableDistributedSampler

        return ResumableDistributedSampler(
            len(self.data.train), rank=rank, world_size=self.world, seed=self.cfg.train.seed, shuffle=True
        )

    def batches(self) -> Iterator[list[dict[str, Any]]]:
        """This rank's micro batches of each optimizer step, exactly as Trainer.run draws them (one DataLoader
        per epoch over the ResumableDistributedSampler)."""
        from torch.utils.data import DataLoader

        sampler = self.sampler(self.rank)
        done, epoch = 0, 0
        while done < self.steps:
            sampler.set_epoch(epoch)
            loader = iter(
                DataLoader(
                    self.data.train, batch_size=self.micro, sampler=sampler, collate_fn=self.collator, drop_last=True
                )
            )
            for _ in range(min(self.steps_per_epoch, self.steps - done)):
                yield [next(loader) for _ in range(self.accum)]
                done += 1
            epoch += 1

    def global_order(self) -> list[int]:
        """Train-set indices laid out so that a sequential sampler sharded the way Accelerate shards it (batch
        i goes to rank i % world) gives each rank ds_exp's micro batches, step by step."""
        per_rank = [self.sampler(r) for r in range(self.world)]
        order: list[int] = []
        for epoch in range(-(-self.steps // self.steps_per_epoch)):
            positions = []
            for sampler in per_rank:
                sampler.set_epoch(epoch)
                positions.append(list(sampler))
            for micro_index in range(self.steps_per_epoch * self.accum):
                for rank_positions in positions:
                    order += rank_positions[micro_index * self.micro : (micro_index + 1) * self.micro]
        return order[: self.steps * self.accum * self.micro * self.world]

    def tokens_per_step(self) -> list[int]:
        """Input tokens (attention-mask ones) of each global step: the sum of its examples' lengths."""
        lengths = [len(ids) for ids in self.data.train["input_ids"]]
        per_step = self.accum * self.micro * self.world
        order = self.global_order()
        return [sum(lengths[i] for i in order[s : s + per_step]) for s in range(0, len(order), per_step)]


def accelerator() -> str:
    """cuda when a GPU is visible (the GPU benchmark), else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed() -> tuple[int, int]:
    """nccl on GPUs (one per local rank), gloo on CPU, through DeepSpeed, as ds_exp does (DeepSpeed's CPU
    accelerator would pick ccl if installed)."""
    import os

    import deepspeed
    import torch
    import torch.distributed as dist

    if accelerator() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if accelerator() == "cuda" else "gloo"
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return dist.get_rank(), dist.get_world_size()


def load_workload(args: argparse.Namespace, rank: int, world: int) -> Workload:
    from ds_exp.data.pipeline import prepare_sft_data
    from ds_exp.model.tokenizer import load_tokenizer
    from ds_exp.train.collate import make_collator

    cfg = compose(args.overrides)
    if int(cfg.dist.sequence_parallel_size) > 1:  # its sampler and steps count every rank as data-parallel
        raise SystemExit(
            "bench: the bare loop and the Trainer have no sequence parallelism; compare at "
            "dist.sequence_parallel_size=1"
        )
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    data = prepare_sft_data(cfg.data, tokenizer, seed=cfg.train.seed)
    collator = make_collator(tokenizer, isolate_packed=bool(cfg.data.packing))
    ds_config = json.loads(args.ds_config.read_text())
    return Workload(cfg, tokenizer, data, collator, ds_config, rank, world, args.steps)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
