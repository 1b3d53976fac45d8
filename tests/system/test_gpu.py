"""The CUDA path, on a real GPU: `python -m pytest -m gpu` (every test here skips cleanly without CUDA).

What a new user on a GPU machine needs to hold: the user's line trains on the first launch with nothing to
compile (even with Hopper's TORCH_CUDA_ARCH_LIST=9.0a), DeepSpeed's FusedAdam still builds when asked for, fp16
overflow skips steps and says so, precision=auto picks bf16, nccl is the backend, peak memory comes from CUDA and
every metric line carries the MFU. bench/gpu_check.py runs these with the user's lines and the throughput
benchmark and writes one results file.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.training import FAST, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
USER_LINE = ("zero=stage3", "precision=bf16", "lora.dim=64")


def gpus() -> int:
    return torch.cuda.device_count()


def test_the_users_line_trains_at_once_with_nothing_to_compile(tmp_path, cache_dir):
    # an empty extension cache: anything DeepSpeed compiled would land here (and take a minute first)
    extensions = tmp_path / "torch_extensions"
    env = {"TORCH_EXTENSIONS_DIR": str(extensions), "TORCH_CUDA_ARCH_LIST": "9.0a"}
    run = launch(tmp_path / "run", *FAST, *USER_LINE, cache_dir=cache_dir, env=env)
    assert run.ok, run.explain()
    assert "ds_exp: compiling" not in run.proc.stderr
    assert not any(extensions.rglob("*.so")), "an op was compiled"
    summary = run.summary
    assert summary["optimizer"] == "AdamW (fused)"
    assert summary["backend"] == "nccl" and summary["accelerator"] == "cuda"
    assert run.losses[-1] < run.losses[0]


def test_deepspeed_fused_adam_builds_with_hoppers_arch_list(tmp_path, cache_dir):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the 9.0a arch list is for Hopper GPUs")
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"), "TORCH_CUDA_ARCH_LIST": "9.0a"}
    run = launch(tmp_path / "run", *FAST, "optimizer.impl=deepspeed_fused", cache_dir=cache_dir, env=env, timeout=900)
    assert run.ok, run.explain()
    assert "ds_exp: compiling DeepSpeed's FusedAdam (fused_adam)" in run.proc.stderr  # said before the build
    assert run.summary["optimizer"] == "FusedAdam"


def test_fp16_overflow_is_counted_and_the_scale_shown(tmp_path, cache_dir):
    run = launch(tmp_path / "run", *FAST, "precision=fp16", "precision.initial_scale_power=32", cache_dir=cache_dir)
    assert run.ok, run.explain()
    lines = run.records("train")
    assert lines[-1]["skipped_steps"] > 0
    scales = [line["loss_scale"] for line in lines]
    assert scales[0] <= 2**32 and scales[-1] < 2**32  # lowered after the overflows
    assert run.summary["skipped_steps"] == lines[-1]["skipped_steps"]


def test_precision_auto_picks_bf16(tmp_path, cache_dir):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    run = launch(tmp_path / "run", *FAST, "precision=auto", cache_dir=cache_dir)
    assert run.ok, run.explain()
    assert run.summary["precision"] == "bf16"


def test_peak_memory_and_mfu_come_from_the_gpu(tmp_path, cache_dir):
    run = launch(tmp_path / "run", *FAST, "precision=bf16", cache_dir=cache_dir)
    assert run.ok, run.explain()
    total = torch.cuda.get_device_properties(0).total_memory
    for line in run.records("train"):
        assert 0 < line["peak_memory_bytes"] < total  # torch.cuda.max_memory_allocated, not the host's RSS
        if run.summary["peak_tflops_per_device"]:  # a GPU in ds_exp/train/flops.py's table
            assert 0 < line["mfu"] < 1
    assert run.summary["device"] == torch.cuda.get_device_name()


def test_two_gpus_rendezvous_over_nccl(tmp_path, cache_dir):
    if gpus() < 2:
        pytest.skip("needs 2 GPUs")
    run = launch(tmp_path / "run", *FAST, "zero=stage2", cache_dir=cache_dir, launcher="torchrun", nproc=2)
    assert run.ok, run.explain()
    assert run.summary["world_size"] == 2 and run.summary["backend"] == "nccl"


@pytest.mark.parametrize(
    ("feature", "package"),
    [
        ("model.liger_kernel=true", "liger_kernel"),
        ("model.attn_implementation=auto", "flash_attn"),
        ("train.compile=true", None),
    ],
)
def test_speed_features_train_like_the_plain_run(tmp_path, cache_dir, feature, package):
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    common = (*FAST, "precision=bf16", "data.packing=true")
    plain = launch(tmp_path / "plain", *common, cache_dir=cache_dir)
    fast = launch(tmp_path / "fast", *common, feature, cache_dir=cache_dir, timeout=900)
    assert plain.ok and fast.ok, plain.explain() + fast.explain()
    # bf16 kernels differ in rounding: the same training, not the same bits
    for a, b in zip(plain.losses, fast.losses, strict=True):
        assert abs(a - b) <= 0.05 * abs(a)
