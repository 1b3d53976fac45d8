"""On CUDA only: tokens/s and model FLOPs utilization (MFU) of a 1.1B Llama in bf16, realistic settings, on every
GPU of the machine (one rank each); ds_exp against the bare DeepSpeed loop and Hugging Face's Trainer, ds_exp's
defaults against the ones before them, and each speed feature on and off.

    python -m bench gpu_throughput            # about 10 launches of ~1 minute; skipped, with the reason, without CUDA
    python -m bench.gpu_throughput --quick    # the four that decide the goal

Model: TinyLlama's shape (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads) with a 32000-token
vocabulary (the embedded tokenizer padded with model.vocab_multiple=32000: the output layer costs what a real
vocabulary costs), random init. Data: the synthetic task packed into rows of 2048 tokens; micro batch 8 x
accumulation 4 = 65536 tokens per optimizer step and GPU. MFU = model FLOPs (ds_exp/train/flops.py: 6 N per token plus
attention over each packed example) / time / the GPU's dense bf16 peak. ds_exp reports it in its metric lines;
the bare loop and the Trainer train the same tokens, so theirs is ds_exp's FLOPs per token x their tokens/s.

Variants (ZeRO-2 unless named): ds_exp; ds_exp with the ZeRO defaults it had before (buckets = hidden^2, overlap
always on); the bare loop and the Trainer with ds_exp's resolved config; the Trainer with its own recommended
settings (Hugging Face's ZeRO-2 template with "auto" values, bf16, its default fused AdamW); ds_exp with
model.attn_implementation=auto (flash-attn varlen over the packed examples), model.liger_kernel=true,
train.compile=true; ds_exp at ZeRO-3 (and its previous defaults). A variant whose package is missing (flash-attn,
liger-kernel) is recorded as skipped. Goal: >= 40% MFU at ZeRO-2 on one H100, ds_exp/bare <= 1.02, and ds_exp
at least as fast as the Trainer with its own settings.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import run, stats, table, torchrun, write_result
from bench.step_time import Setup, measure_script, pooled, shared_overrides

SEQ_LEN, MICRO_BATCH, ACCUMULATION = 2048, 8, 4
MODEL = (
    "model.arch.hidden_size=2048",
    "model.arch.intermediate_size=5632",
    "model.arch.num_hidden_layers=22",
    "model.arch.num_attention_heads=32",
    "model.arch.num_key_value_heads=4",
    f"model.arch.max_position_embeddings={SEQ_LEN}",
    "model.arch.tie_word_embeddings=false",
    "model.vocab_multiple=32000",
)
WORKLOAD = (
    *MODEL,
    "precision=bf16",
    "data.packing=true",
    f"data.max_seq_len={SEQ_LEN}",
    "data.synthetic.num_train=150000",
    f"train.micro_batch_size={MICRO_BATCH}",
    f"train.gradient_accumulation_steps={ACCUMULATION}",
)
# ds_exp's zero=stage2 / stage3 groups before issue 12 (Hugging Face's "auto" buckets, overlap_comm always on)
PREVIOUS_DEFAULTS = {
    2: ("zero.reduce_bucket_size=auto", "zero.allgather_bucket_size=500000000", "zero.overlap_comm=true"),
    3: (
        "zero.reduce_bucket_size=auto",
        "zero.stage3_prefetch_bucket_size=auto",
        "zero.stage3_param_persistence_threshold=auto",
        "zero.overlap_comm=true",
    ),
}
# name -> (ZeRO stage, how it runs, extra ds_exp overrides)
VARIANTS: dict[str, tuple[int, str, tuple[str, ...]]] = {
    "ds_exp": (2, "ds_exp", ()),
    "ds_exp_previous_defaults": (2, "ds_exp", PREVIOUS_DEFAULTS[2]),
    "bare": (2, "bare", ()),
    "hf_trainer": (2, "hf_trainer", ()),
    "hf_trainer_recommended": (2, "hf_trainer_recommended", ()),
    "ds_exp_flash_attn": (2, "ds_exp", ("model.attn_implementation=auto",)),
    "ds_exp_liger": (2, "ds_exp", ("model.liger_kernel=true",)),
    "ds_exp_compile": (2, "ds_exp", ("train.compile=true",)),
    "ds_exp_zero3": (3, "ds_exp", ()),
    "ds_exp_zero3_previous_defaults": (3, "ds_exp", PREVIOUS_DEFAULTS[3]),
}
QUICK = ("ds_exp", "ds_exp_previous_defaults", "bare", "hf_trainer_recommended")
NEEDS = {"ds_exp_flash_attn": "flash_attn", "ds_exp_liger": "liger_kernel"}
GOAL_MFU = 0.40


def measure_ds_exp(
    setup: Setup, name: str, stage: int, extra: tuple[str, ...], work: Path, timeout: float = 1200
) -> dict[str, Any]:
    """One torchrun launch of ds_exp; its metric lines after warm-up give step time, tokens/s and MFU."""
    run_dir = work / name
    overrides = [
        *shared_overrides(setup, stage, work / "data_cache"),
        *extra,
        "train.eval_at_start=false",
        f"train.eval_every={setup.steps}",
        "train.export=false",
        "train.save_final_checkpoint=false",
        f"hydra.run.dir={run_dir}",
    ]
    started = time.perf_counter()
    try:
        wall, output = run(torchrun(setup.nproc, "-m", "ds_exp", *overrides), cwd=work, timeout=timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return {"error": str(err)[-3000:], "launch_wall_s": time.perf_counter() - started}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["type"] == "train"][setup.warmup_windows :]
    mfus = [r["mfu"] for r in train if r.get("mfu") is not None]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "launch_wall_s": wall,
        "step_time_s": stats([r["step_time_s"] for r in train]),
        "tokens_per_s": stats([r["tokens_per_s"] for r in train]).get("median"),
        "mfu": stats(mfus).get("median") if mfus else None,
        "flops_per_token": stats([r["tflops_per_device"] * 1e12 / r["tokens_per_s_per_device"] for r in train]).get(
            "median"
        ),
        "peak_memory_bytes_per_rank": summary.get("peak_memory_bytes_per_rank"),
        "compiled_an_op": "ds_exp: compiling" in output,
        "ds_config": str(run_dir / "ds_config.json"),
        "final_loss": train[-1]["loss"] if train else None,
    }


def main(quick: bool = False, deadline: float | None = None) -> dict[str, Any] | None:
    """`deadline` (a time.perf_counter() value): variants that would start past it are recorded as not run."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device here (this benchmark needs a GPU; the CPU set does not)")
        return None
    gpus, device = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    setup = Setup(nproc=gpus, steps=15 if quick else 30, window=5, warmup_windows=1, reps=1, overrides=WORKLOAD)
    names = QUICK if quick else tuple(VARIANTS)
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    results: dict[str, dict[str, Any]] = {}
    ds_configs: dict[int, Path] = {}
    started = time.perf_counter()
    try:
        for name in names:
            stage, method, extra = VARIANTS[name]
            left = (deadline - time.perf_counter()) if deadline else 1200.0
            print(f"{name}: ZeRO-{stage} {' '.join(extra)}", flush=True)
            if left < 90:
                results[name] = {"skipped": f"not run: {left:.0f} s were left before the deadline"}
            elif name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
                results[name] = {"skipped": f"{NEEDS[name]} is not installed"}
            elif method == "ds_exp":
                results[name] = measure_ds_exp(setup, name, stage, extra, work, timeout=min(left, 1200))
                if not extra and "ds_config" in results[name]:
                    ds_configs[stage] = Path(results[name]["ds_config"])
            elif stage not in ds_configs:
                results[name] = {"error": f"no ds_config.json: the plain ds_exp run at ZeRO-{stage} failed"}
            else:
                config = ds_configs[stage]  # the bare loop and the Trainer train with the config ds_exp resolved
                script_method = "hf_trainer" if method.startswith("hf_trainer") else method
                extra_args = ("--recommended",) if method == "hf_trainer_recommended" else ()
                try:  # pooled: one launch's windows as step_time_s / tokens_per_s, like ds_exp's
                    results[name] = pooled(
                        [measure_script(script_method, setup, stage, 0, work, work / "data_cache", config, extra_args)]
                    )
                except (RuntimeError, subprocess.TimeoutExpired) as err:  # one variant's failure is its result
                    results[name] = {"error": str(err)[-3000:]}
            print(f"  {describe(results[name])}", flush=True)
            write_result("gpu_throughput_quick" if quick else "gpu_throughput", summarize(results, gpus, device, setup))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    payload = summarize(results, gpus, device, setup)
    payload["total_wall_s"] = time.perf_counter() - started
    print(payload["table"])
    write_result("gpu_throughput_quick" if quick else "gpu_throughput", payload)
    return payload


def describe(result: dict[str, Any]) -> str:
    if "skipped" in result or "error" in result:
        return str(result.get("skipped") or result["error"][-500:])
    mfu = result.get("mfu")
    return f"{result.get('tokens_per_s') or 0:,.0f} tokens/s" + (f", MFU {mfu:.1%}" if mfu else "")


def summarize(results: dict[str, dict[str, Any]], gpus: int, device: str, setup: Setup) -> dict[str, Any]:
    """MFU for the bare loop and the Trainer from ds_exp's FLOPs per token; ratios; the goal, met or not."""
    from ds_exp.train.flops import peak_flops

    peak = peak_flops(device, "bf16")
    per_token = results.get("ds_exp", {}).get("flops_per_token")
    for result in results.values():
        tokens = result.get("tokens_per_s")
        if result.get("mfu") is None and tokens and per_token and peak:
            result["mfu"] = tokens * per_token / gpus / peak

    def step_ms(name: str) -> float | None:
        median = (results.get(name, {}).get("step_time_s") or {}).get("median")
        return median * 1e3 if median else None

    def ratio(a: str, b: str) -> float | None:
        top, bottom = step_ms(a), step_ms(b)
        return top / bottom if top and bottom else None

    mfu = results.get("ds_exp", {}).get("mfu")
    goal = {
        "mfu_zero2": mfu,
        "mfu_target": GOAL_MFU,
        "ds_exp/bare": ratio("ds_exp", "bare"),
        "ds_exp/Trainer_recommended": ratio("ds_exp", "hf_trainer_recommended"),
        "ds_exp/previous_defaults": ratio("ds_exp", "ds_exp_previous_defaults"),
        "met": bool(mfu and mfu >= GOAL_MFU and (ratio("ds_exp", "bare") or 9) <= 1.02),
    }
    rows = [
        [
            name,
            step_ms(name),
            result.get("tokens_per_s"),
            f"{result['mfu']:.1%}" if result.get("mfu") else None,
            result.get("skipped") or ("failed" if "error" in result else "ok"),
        ]
        for name, result in results.items()
    ]
    return {
        "setup": {"gpus": gpus, "device": device, "overrides": list(setup.overrides), "steps": setup.steps},
        "peak_bf16_flops_per_gpu": peak,
        "variants": results,
        "goal": goal,
        "table": table(["variant", "ms/step (median)", "tokens/s", "MFU", "status"], rows),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the variants that decide the goal")
    main(quick=parser.parse_args(sys.argv[1:]).quick)
