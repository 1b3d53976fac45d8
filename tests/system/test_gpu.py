"""The CUDA path, on a real GPU: `python -m pytest -m gpu` (every test here skips cleanly without CUDA).

What a new user on a GPU machine needs to hold: the user's line trains on the first launch with nothing to
compile (even with Hopper's TORCH_CUDA_ARCH_LIST=9.0a), DeepSpeed's FusedAdam still builds when asked for, fp16
overflow skips steps and says so, precision=auto picks bf16, nccl is the backend, peak memory comes from CUDA and
every metric line carries both MFUs; the fast path (issue 32) is the default and learns what the plain path learns,
and what only a GPU runs computes what torch does: Liger's kernels and fused loss in bf16, torch's varlen kernel
keeping packed examples apart. bench/gpu_check.py runs these with the user's lines and the throughput benchmark
and writes one results file.
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


PLAIN = ("model.liger_kernel=false", "model.fused_loss=false", "train.compile=false", "model.attn_implementation=null")
VARLEN = ("flash_attention_2", "torch_varlen")


@pytest.mark.parametrize("stage", [2, 3])
def test_the_fast_path_is_the_default_and_trains_like_the_plain_path(tmp_path, cache_dir, stage):
    """The user's line with no speed flags runs Liger's kernels, the fused loss, a varlen attention over packed rows
    and (ZeRO 0-2) compiled layers, and learns what the plain path learns (bf16 rounding apart)."""
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed (pip install '.[gpu]')")
    common = (*FAST, f"zero=stage{stage}", "precision=bf16", "data.packing=true", "lora.dim=8")
    plain = launch(tmp_path / "plain", *common, *PLAIN, cache_dir=cache_dir)
    fast = launch(tmp_path / "fast", *common, cache_dir=cache_dir, timeout=900)
    assert plain.ok and fast.ok, plain.explain() + fast.explain()
    used = fast.summary["fast_path"]
    assert used["attention"] in VARLEN and used["liger_kernel"] and used["fused_loss"]
    assert used["compile"] == (stage < 3) and (fast.summary["compile_s"] or 0) > (0 if stage < 3 else -1)
    off = {"attention": "sdpa", "liger_kernel": False, "fused_loss": False, "compile": False}
    assert plain.summary["fast_path"] == off
    for a, b in zip(plain.losses, fast.losses, strict=True):  # bf16 kernels differ in rounding: the same training
        assert abs(a - b) <= 0.05 * abs(a)
    line = fast.records("train")[-1]
    assert 0 < line["mfu"] <= line["mfu_with_attention"] < 1  # torchtitan's count adds the rows' attention


def tiny_on_gpu(compose_cfg, *overrides: str):
    """The tiny model as ds_exp builds it, in bf16 on the GPU (no DeepSpeed: the kernels are what is under test)."""
    from ds_exp.model.build import build_model
    from ds_exp.model.tokenizer import load_tokenizer

    cfg = compose_cfg("precision=bf16", "train.compile=false", *overrides)
    ds_config = {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}  # auto's attention reads the dtype
    built = build_model(cfg, load_tokenizer(cfg.model, cfg.data), ds_config)
    built.model.to("cuda", torch.bfloat16)
    return built


def test_liger_kernels_and_the_fused_loss_compute_what_torch_does(compose_cfg):
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed")
    from ds_exp.train.step import batch_loss

    plain = tiny_on_gpu(compose_cfg, *PLAIN)
    fast = tiny_on_gpu(compose_cfg, "model.attn_implementation=null")
    assert fast.fast_path["liger_kernel"] and fast.fast_path["fused_loss"]
    fast.model.load_state_dict(plain.model.state_dict())
    ids = torch.randint(5, 200, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    losses, grads = [], []
    for built in (plain, fast):
        built.model.zero_grad()
        summed, count = batch_loss(built.loss, built.model, batch)
        (summed / count).backward()
        losses.append(float(summed.detach() / count))
        grads.append({n: p.grad.float() for n, p in built.model.named_parameters() if p.grad is not None})
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    for name, grad in grads[0].items():
        assert torch.nn.functional.cosine_similarity(grad.flatten(), grads[1][name].flatten(), dim=0) > 0.99, name


@pytest.mark.parametrize("attention", VARLEN)
def test_a_varlen_attention_keeps_packed_examples_apart_on_the_gpu(compose_cfg, attention):
    """Rows of several packed examples, more than one row per batch (where transformers' flash path alone would let
    the examples of a row attend to each other)."""
    from ds_exp.fast_path.attention import example_boundaries, torch_varlen_works

    if attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    if attention == "torch_varlen":
        assert torch_varlen_works(), "torch's varlen kernel does not run on this GPU"
    model = tiny_on_gpu(compose_cfg, f"model.attn_implementation={attention}").model.eval()
    ids = torch.randint(5, 200, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    examples = [(0, 0, 5), (0, 5, 12), (0, 12, 16), (1, 0, 9), (1, 9, 16)]
    positions = torch.zeros_like(ids)
    for row, a, b in examples:
        positions[row, a:b] = torch.arange(b - a)
    boundaries = example_boundaries({"input_ids": ids.cpu(), "position_ids": positions.cpu()})
    boundaries = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in boundaries.items()}
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, **boundaries, use_cache=False).logits.float()
        for row, a, b in examples:
            alone = model(input_ids=ids[row : row + 1, a:b], use_cache=False).logits[0].float()
            torch.testing.assert_close(packed[row, a:b], alone, rtol=2e-2, atol=2e-2)
