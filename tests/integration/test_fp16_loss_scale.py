"""fp16's loss scale reaches the gradients at every ZeRO stage, on real DeepSpeed engines in this process.

DeepSpeed 0.19.8 leaves the loss unscaled at ZeRO stage 0 while its fp16 optimizer divides the gradients by the scale
(deepspeedai/DeepSpeed#8393; ds_exp.train.step.Fp16LossScale): the GPU check found it, as fp16 runs that never
overflowed with a loss scale of 2^32. DeepSpeed's CPU accelerator refuses fp16 only because oneDNN's fp16 kernels are
missing; torch's own CPU kernels run a tiny model's fp16 step, which is all these tests need.
"""

from __future__ import annotations

import deepspeed
import deepspeed.ops
import pytest
import torch
import torch.distributed as dist
import transformers
from deepspeed.accelerator import get_accelerator

from ds_exp.model.engine import release_engine
from ds_exp.runtime.process_group import release_process_groups
from ds_exp.train.flops import FlopsModel
from ds_exp.train.step import TrainStep


@pytest.fixture
def fp16_engine(tmp_path, monkeypatch):
    """Builds tiny Llama engines in fp16 on a one-rank gloo group; released (and the group destroyed) after."""
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    # DeepSpeed's shared-memory collectives are an optimization: not worth a compile in the test process
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", False)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    built = []

    def build(stage: int, initial_scale_power: int) -> object:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
        model = transformers.LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ds_config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "fp16": {"enabled": True, "initial_scale_power": initial_scale_power},
            "zero_optimization": {"stage": stage},
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        built.append(engine)
        return engine

    yield build
    for engine in built:
        release_engine(engine)
    release_process_groups()  # as a run's exit does: DeepSpeed's references to the group dropped too


def micro_batches() -> list[dict]:
    torch.manual_seed(1)
    ids = [torch.randint(0, 256, (2, 16)) for _ in range(2)]
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()} for x in ids]


def step(engine) -> bool:
    train_step = TrainStep(engine, world_size=1, flops=FlopsModel(1, 1, 1, 1))
    return train_step(micro_batches(), stop_requested=False, previous_loss=None).applied


@pytest.mark.parametrize("stage", [0, 1])
def test_a_loss_scale_too_large_for_fp16_overflows_and_skips_the_step(fp16_engine, stage):
    # 2^32 x this loss's gradients is far past fp16's 65504: the step must be skipped and the scale lowered. At stage
    # 0, before the fix, the loss reached the backward unscaled: every step applied, updates 2^32 times too small.
    engine = fp16_engine(stage, initial_scale_power=32)
    assert not step(engine)
    assert engine.skipped_steps == 1
    assert step(engine) or engine.optimizer.loss_scale < 2**32  # lowered (at once, or after ZeRO's hysteresis)


def test_a_deepspeed_that_scales_the_loss_itself_is_not_scaled_twice(fp16_engine):
    norms = {}
    for name in ("as_0_19_8", "fixed"):
        engine = fp16_engine(0, initial_scale_power=8)
        if name == "fixed":  # engine.backward as deepspeedai/DeepSpeed#8393 would make it: the loss scaled there
            unfixed = engine.backward
            engine.backward = lambda loss, unfixed=unfixed, engine=engine: unfixed(loss * engine.optimizer.loss_scale)
        real_step = engine.step

        def spy(engine=engine, real_step=real_step, name=name) -> None:
            if engine.is_gradient_accumulation_boundary():  # the scaled gradients the optimizer will unscale
                grads = [p.grad.float() for p in engine.module.parameters() if p.grad is not None]
                norms[name] = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            real_step()

        engine.step = spy
        assert step(engine)
    # each is the gradient x 2^8 (twice scaled would be x 2^16)
    assert norms["fixed"] == pytest.approx(norms["as_0_19_8"], rel=1e-3)
