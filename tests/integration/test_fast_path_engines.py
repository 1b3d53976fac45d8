"""Liger's fused loss on real DeepSpeed engines in this process (a one-rank gloo group) at ZeRO-3, with LoRA:
the losses of three optimizer steps through ds_exp's step are the plain path's. At ZeRO-3 the output layer's weight is
released outside its module's call (an empty tensor): the fused loss runs inside that call, where DeepSpeed has
gathered it (ds_exp/model/head_loss.py; TRL read the released weight: huggingface/trl#3368, #4544). Liger's kernel
runs through Triton's interpreter here (tests/conftest.py)."""

from __future__ import annotations

import deepspeed
import deepspeed.ops
import pytest
import torch
import torch.distributed as dist

from ds_exp.fast_path.settings import liger_installed
from ds_exp.model.build import build_model
from ds_exp.model.engine import release_engine
from ds_exp.model.tokenizer import load_tokenizer
from ds_exp.runtime.process_group import release_process_groups
from ds_exp.train.flops import FlopsModel
from ds_exp.train.step import TrainStep
from tests.training import assert_close


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    # DeepSpeed's shared-memory collectives are an optimization: not worth a compile in the test process
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", False)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    engines: list = []
    yield engines
    for engine in engines:
        release_engine(engine)
    release_process_groups()


def train(compose_cfg, engines: list, stage: int, *overrides: str) -> tuple[list[float], object]:
    cfg = compose_cfg("precision=fp32", "train.micro_batch_size=2", "data.max_seq_len=24", *overrides)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    built = build_model(cfg, load_tokenizer(cfg.model, cfg.data), ds_config)
    params = [p for p in built.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    engine, *_ = deepspeed.initialize(model=built.model, optimizer=optimizer, config=ds_config)
    engines.append(engine)
    step = TrainStep(engine, world_size=1, flops=FlopsModel(1, 1, 1, 1), loss=built.loss)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(3):
        batches = []
        for _ in range(2):
            ids = torch.randint(5, 200, (2, 24), generator=generator)
            labels = ids.clone()
            labels[:, :6] = -100
            batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
        result = step(batches, stop_requested=False, previous_loss=None)
        losses.append(float(result.loss_sum) / result.votes.global_label_tokens)
    return losses, built


@pytest.mark.skipif(not liger_installed(), reason="liger-kernel is not installed (pip install '.[dev]')")
def test_the_fused_loss_trains_like_the_plain_loss_at_zero3(compose_cfg, one_rank):
    """(ZeRO-0 is tests/unit/test_fast_path.py's, without an engine: nothing is partitioned there.)"""
    lora = ("lora.dim=4", "lora.modules_to_save=[lm_head]")  # adapters in the layers, lm_head trained whole
    plain, _ = train(compose_cfg, one_rank, 3, *lora, "model.fused_loss=false")
    fused, built = train(compose_cfg, one_rank, 3, *lora, "model.fused_loss=true")
    assert built.fast_path["fused_loss"]
    assert_close(fused, plain, rel=1e-5)
    assert fused[-1] < fused[0]
    # what a loss computed outside the output layer's call would have read
    assert built.model.get_output_embeddings().modules_to_save["default"].weight.numel() == 0
