"""The GPU path's pieces that can be proven on a CPU: the optimizer choice, DeepSpeed op builds (notice, clear
failure, fallback), MFU accounting, ZeRO defaults chosen per world size. tests/system/test_gpu.py runs the rest on
CUDA."""

from __future__ import annotations

import stat

import pytest

from ds_exp.config.ds_config import RunFacts, resolve_ds_config
from ds_exp.model.optimizers import optimizer_impl
from ds_exp.runtime.ops import deepspeed_arch_list
from ds_exp.train.flops import FlopsModel, flops_model, peak_flops, sum_squared_lengths
from tests.training import FAST, launch, train_here


@pytest.mark.parametrize(
    ("overrides", "accelerator", "expected"),
    [
        ((), "cuda", "torch_fused"),  # nothing to compile on a GPU
        ((), "cpu", "torch"),
        (("zero=stage2", "offload=cpu"), "cuda", "deepspeed_cpu"),  # the offloaded step runs on the host
        (("zero=stage2", "offload=cpu"), "cpu", "deepspeed_cpu"),
        (("optimizer.impl=deepspeed_fused",), "cuda", "deepspeed_fused"),
        (("optimizer.impl=torch_fused",), "cpu", "torch_fused"),
    ],
)
def test_optimizer_choice(compose_cfg, overrides, accelerator, expected):
    cfg = compose_cfg(*overrides)
    ds = resolve_ds_config(cfg, RunFacts(world_size=1, hidden_size=64, total_steps=10, precision="fp32", run_dir="/r"))
    assert optimizer_impl(cfg.optimizer, ds, accelerator) == expected


def test_optimizer_that_cannot_work_with_offload_is_refused(tmp_path):
    from tests.conftest import run_cli

    proc = run_cli("zero=stage2", "offload=cpu", "optimizer.impl=torch_fused", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "optimizer.impl=torch_fused with offload.optimizer=cpu" in proc.stderr
    assert "optimizer.impl=auto" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("value", "fixed"),
    [
        ("9.0a", "9.0"),  # Hopper's arch-specific code: DeepSpeed 0.19's parser fails on "0a"
        ("8.0;9.0a+PTX", "8.0;9.0+PTX"),
        ("8.6 9.0a 10.0f", "8.6;9.0;10.0"),
        ("8.0;9.0", None),  # nothing to change: left alone
        ("", None),
        (None, None),
    ],
)
def test_arch_list_deepspeed_can_parse(value, fixed):
    assert deepspeed_arch_list(value) == fixed


def test_peak_table_and_override():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756.5e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5e12)
    assert peak_flops("NVIDIA Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 tensor cores
    assert peak_flops(None, "bf16") is None  # a CPU: no MFU unless the peak is given
    assert peak_flops(None, "fp32", override_tflops=2.5) == pytest.approx(2.5e12)


def test_flops_count_the_weights_that_multiply(compose_cfg):
    import torch
    from transformers import AutoModelForCausalLM

    from ds_exp.model.architecture import build_model_config
    from ds_exp.model.tokenizer import load_tokenizer

    for tied in (True, False):
        cfg = compose_cfg(f"model.arch.tie_word_embeddings={tied}")
        config = build_model_config(cfg.model, load_tokenizer(cfg.model, cfg.data))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        total = sum(p.numel() for p in model.parameters())
        embedding = model.get_input_embeddings().weight.numel()
        fm = flops_model(model, config)
        assert fm.matmul_params == (total if tied else total - embedding)  # a lookup costs no multiplies
        assert fm.trainable_matmul_params == fm.matmul_params
        assert (fm.layers, fm.hidden) == (2, 128)
        # a full fine-tune: 6 N per token, plus 12 L h n^2 for a sequence of n tokens
        assert fm.per_batch(10, 100) == 6 * fm.matmul_params * 10 + 12 * 2 * 128 * 100
    frozen = FlopsModel(matmul_params=1000, trainable_matmul_params=10, layers=1, hidden=1)
    assert frozen.per_batch(1, 0) == 4 * 1000 + 2 * 10  # LoRA: no weight gradients for the frozen base


def test_attention_pairs_of_padded_and_packed_batches():
    import torch

    padded = {"input_ids": torch.zeros(2, 5), "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    assert sum_squared_lengths(padded) == 3**2 + 5**2
    packed = {"input_ids": torch.zeros(2, 6), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])}
    assert sum_squared_lengths(packed) == (9 + 9) + (4 + 16)


def test_overlap_comm_only_where_there_is_communication(compose_cfg):
    for stage in (1, 2, 3):
        cfg = compose_cfg(f"zero=stage{stage}")
        for world, overlap in ((1, False), (2, True), (8, True)):
            facts = RunFacts(world_size=world, hidden_size=64, total_steps=10, precision="bf16", run_dir="/r")
            zero = resolve_ds_config(cfg, facts)["zero_optimization"]
            assert zero["overlap_comm"] is overlap, (stage, world)
            assert zero["reduce_bucket_size"] >= 2e8  # few large buckets, not hidden^2 = 4096 elements
    # a user's explicit choice wins
    cfg = compose_cfg("zero=stage2", "zero.overlap_comm=true")
    facts = RunFacts(world_size=1, hidden_size=64, total_steps=10, precision="bf16", run_dir="/r")
    assert resolve_ds_config(cfg, facts)["zero_optimization"]["overlap_comm"] is True


def test_mfu_tokens_per_device_and_optimizer_in_metrics_and_summary(tmp_path, cache_dir):
    run = train_here(tmp_path / "run", *FAST, "train.peak_tflops=0.5", cache_dir=cache_dir)
    assert run.ok, run.explain()
    lines = run.records("train")
    for line in lines:
        assert line["mfu"] == pytest.approx(line["tflops_per_device"] / 0.5)
        assert line["tokens_per_s_per_device"] == pytest.approx(line["tokens_per_s"])  # one rank
        assert 0 < line["mfu"] < 1 and line["skipped_steps"] == 0 and line["loss_scale"] is None
    summary = run.summary
    assert summary["optimizer"] == "AdamW"
    assert summary["peak_tflops_per_device"] == pytest.approx(0.5)
    assert 0 < summary["mfu"] < 1 and summary["tokens_per_s_per_device"] > 0


def test_without_a_known_peak_mfu_is_left_out(tmp_path, cache_dir):
    run = train_here(tmp_path / "run", *FAST, "train.max_steps=2", cache_dir=cache_dir)
    assert run.ok, run.explain()
    assert all(line["mfu"] is None and line["tflops_per_device"] > 0 for line in run.records("train"))
    assert run.summary["mfu"] is None and run.summary["device"] is None


@pytest.fixture
def broken_compiler(tmp_path):
    """An empty torch extension cache (so DeepSpeed's ops must be compiled) and a C++ compiler that fails."""
    fake = tmp_path / "bin" / "c++"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "c++: error: broken on purpose" >&2\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return {"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "CXX": str(fake)}


def test_an_op_that_cannot_be_compiled_is_named_with_its_fix(tmp_path, cache_dir, broken_compiler):
    # CPU Adam is what optimizer offload needs: without it the run stops at once, with the op, cause and fix
    run = launch(tmp_path / "run", *FAST, "zero=stage1", "offload=cpu", cache_dir=cache_dir, env=broken_compiler)
    assert run.proc.returncode == 1, run.explain()
    err = run.proc.stderr
    assert "Traceback" not in err
    assert "ds_exp: compiling DeepSpeed's CPU Adam (cpu_adam)" in err  # said before the (long) build
    assert "could not compile DeepSpeed's CPU Adam (cpu_adam), needed for optimizer offload" in err
    assert f"the C++ compiler ({broken_compiler['CXX']}) does not run" in err and "apt-get install g++" in err
    assert "offload=none" in err  # how to do without it
    assert not run.run_dir.exists()  # refused before any training: nothing left that looks like a run


def test_without_the_shared_memory_op_cpu_ranks_train_on(tmp_path, cache_dir, broken_compiler):
    # the CPU collectives op is an optimization: a warning, then plain gloo collectives, same losses
    run = launch(tmp_path / "run", *FAST, cache_dir=cache_dir, env=broken_compiler, launcher="torchrun", nproc=2)
    assert run.ok, run.explain()
    assert "ds_exp: warning: could not compile DeepSpeed's shared-memory collectives" in run.proc.stderr
    assert run.proc.stderr.count("could not compile") == 1  # rank 0 says it, once
    reference = launch(tmp_path / "ref", *FAST, cache_dir=cache_dir, launcher="torchrun", nproc=2)
    assert reference.ok, reference.explain()
    assert run.losses == pytest.approx(reference.losses, rel=1e-6)
