"""On CUDA only: tokens/s and model FLOPs utilization (MFU) of ds_exp's default line (the fast path on) against each
fast-path piece off, the path before it, the bare DeepSpeed loop and Hugging Face's Trainer with its recommended
settings, plus an 8B LoRA at ZeRO-3; every variant a separate launch, one after another, nothing beside it.

    python -m bench.gpu_throughput              # every variant (~10 minutes on an H100; skipped without CUDA)
    python -m bench.gpu_throughput --dry-run    # on any machine: each variant's command, config checked, memory plan

Workload (issue 32): TinyLlama's shape (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads) with a
32000-token vocabulary (the embedded tokenizer padded with model.vocab_multiple=32000: the output layer costs what a
real vocabulary costs), random init, bf16, ZeRO-2, the synthetic task packed into rows of 2048 tokens, micro batch 8 x
accumulation 4 = 65536 tokens per optimizer step and GPU. `lora_8b_zero3`: Llama-3-8B's config (random init), bf16,
rows of 4096 packed tokens, LoRA rank 64 in the decoder layers, ZeRO-3 on one GPU, micro batch and checkpointing from
ds_exp's memory plan for the GPU's memory (ds_exp/config/memory_plan.py plan_micro_batch).

MFU in two counts (ds_exp/train/flops.py): `mfu`, ds_exp's (6 N without the input embedding, LoRA 4 N + 2 N_trainable,
plus the attention of each packed example), and `mfu_with_attention`, torchtitan's and llm-foundry's (6 N + 12 L d s
per token, s the row length: their published figures use it). The bare loop and the Trainer train the same tokens, so
theirs is ds_exp's FLOPs per token (each count) x their tokens/s. Compile time (train.compile) is its own figure
(`compile_s`), never in step time: the first metric window (warm-up, compile included) is not measured.

Goals: ds_exp's default >= 40% MFU (ds_exp's count) and >= 1.4x the Trainer's tokens/s, its losses those of the plain
path within bf16 noise; lora_8b_zero3 >= 35% MFU (ds_exp's count: 4 N + attention).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import compose, run, stats, table, torchrun, write_result
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
LLAMA3_8B = (
    "model.arch.hidden_size=4096",
    "model.arch.intermediate_size=14336",
    "model.arch.num_hidden_layers=32",
    "model.arch.num_attention_heads=32",
    "model.arch.num_key_value_heads=8",
    "model.arch.max_position_embeddings=8192",
    "model.arch.rms_norm_eps=1e-5",
    "+model.arch.rope_theta=500000.0",
    "model.arch.tie_word_embeddings=false",
    "model.vocab_multiple=128256",
)
LORA_8B = (
    *LLAMA3_8B,
    "precision=bf16",
    "lora.dim=64",
    "data.packing=true",
    "data.max_seq_len=4096",
    "data.synthetic.num_train=150000",
    "train.gradient_accumulation_steps=4",
)
# the path before issue 32: no Liger kernels, the loss from the full logits, eager layers, SDPA with transformers'
# block mask over packed rows. What the bare loop and the Trainer train with (what users have without ds_exp).
PLAIN = ("model.liger_kernel=false", "model.fused_loss=false", "train.compile=false", "model.attn_implementation=null")
# name -> (ZeRO stage, how it runs, extra overrides), in the order they run: a deadline drops the last ones
VARIANTS: dict[str, tuple[int, str, tuple[str, ...]]] = {
    "ds_exp": (2, "ds_exp", ()),  # the user's line: the fast path is the default
    "hf_trainer_recommended": (2, "hf_trainer_recommended", PLAIN),
    "lora_8b_zero3": (3, "ds_exp", LORA_8B),
    "ds_exp_no_compile": (2, "ds_exp", ("train.compile=false",)),
    "ds_exp_no_fused_loss": (2, "ds_exp", ("model.fused_loss=false",)),
    "ds_exp_no_liger": (2, "ds_exp", ("model.liger_kernel=false",)),
    "ds_exp_no_varlen": (2, "ds_exp", ("model.attn_implementation=null",)),
    "ds_exp_plain": (2, "ds_exp", PLAIN),
    "bare": (2, "bare", PLAIN),
}
# about how long each launch takes on an H100 (start, build, compile, steps), to skip what would pass the deadline
EXPECTED_S = {"lora_8b_zero3": 150, "ds_exp": 100, "ds_exp_no_liger": 100, "ds_exp_no_varlen": 100}
DEFAULT_EXPECTED_S = 75
STEPS, WINDOW, WARMUP_WINDOWS = 11, 2, 1  # the first 3 steps (compile, allocator) are warm-up: 4 windows measured
QUICK = ("ds_exp", "hf_trainer_recommended", "lora_8b_zero3", "ds_exp_plain")
GOALS = {"mfu": 0.40, "vs_trainer": 1.4, "lora_8b_mfu": 0.35, "loss_vs_plain": 0.03}


def variant_overrides(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The variant's workload and extra overrides (the 8B LoRA has its own workload, the micro batch planned)."""
    extra = VARIANTS[name][2]
    if name == "lora_8b_zero3":
        return (), extra
    return WORKLOAD, extra


def measure_ds_exp(setup: Setup, name: str, extra: tuple[str, ...], work: Path, timeout: float) -> dict[str, Any]:
    """One torchrun launch of ds_exp; its metric lines after warm-up give step time, tokens/s and both MFUs."""
    stage = VARIANTS[name][0]
    run_dir = work / name
    overrides = [
        *shared_overrides(setup, stage, work / "data_cache"),
        *extra,
        "train.eval_at_start=false",
        f"train.eval_every={setup.steps}",
        "eval.max_new_tokens=8",
        "train.export=false",
        "train.save_final_checkpoint=false",
        f"hydra.run.dir={run_dir}",
    ]
    started = time.perf_counter()
    try:
        wall, _ = run(torchrun(setup.nproc, "-m", "ds_exp", *overrides), cwd=work, timeout=timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return {"error": str(err)[-3000:], "launch_wall_s": time.perf_counter() - started}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    every = [r for r in lines if r["type"] == "train"]
    train = every[setup.warmup_windows :]
    summary = json.loads((run_dir / "summary.json").read_text())

    def median(key: str) -> float | None:
        values = [r[key] for r in train if r.get(key) is not None]
        return stats(values).get("median") if values else None

    per_token = [r["tflops_per_device"] * 1e12 / r["tokens_per_s_per_device"] for r in train]
    return {
        "launch_wall_s": wall,
        "step_time_s": stats([r["step_time_s"] for r in train]),
        "tokens_per_s": median("tokens_per_s"),
        "mfu": median("mfu"),
        "mfu_with_attention": median("mfu_with_attention"),
        "flops_per_token": stats(per_token).get("median"),
        "flops_ratio_with_attention": (median("mfu_with_attention") or 0) / (median("mfu") or 1),
        "peak_memory_bytes_per_rank": summary.get("peak_memory_bytes_per_rank"),
        "compile_s": summary.get("compile_s"),
        "fast_path": summary.get("fast_path"),
        "losses": [r["loss"] for r in every],
        "final_loss": every[-1]["loss"] if every else None,
        "micro_batch_size": json.loads((run_dir / "ds_config.json").read_text())["train_micro_batch_size_per_gpu"],
        "ds_config": str(run_dir / "ds_config.json"),
    }


def planned_lora_8b(gpu_bytes: int) -> tuple[str, ...]:
    """lora_8b_zero3's micro batch and checkpointing from ds_exp's memory plan for this GPU."""
    from ds_exp.config.memory_plan import plan_micro_batch
    from ds_exp.model.architecture import model_facts

    cfg = compose(*LORA_8B, "zero=stage3", "train.micro_batch_size=1")
    micro, checkpointing = plan_micro_batch(cfg, model_facts(cfg), gpu_bytes, precision="bf16", world_size=1)
    return (f"train.micro_batch_size={micro}", f"model.gradient_checkpointing={str(checkpointing).lower()}")


def main(
    quick: bool = False, deadline: float | None = None, names: tuple[str, ...] = tuple(VARIANTS)
) -> dict[str, Any] | None:
    """`deadline` (a time.perf_counter() value): variants that would end past it are recorded as not run; `quick`:
    the three that decide the goals (ds_exp's default, the Trainer, lora_8b_zero3) and the plain path."""
    if quick:
        names = tuple(n for n in names if n in QUICK)
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device here (this benchmark needs a GPU; --dry-run checks it anywhere)")
        return None
    gpus, device = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    setup = Setup(nproc=gpus, steps=STEPS, window=WINDOW, warmup_windows=WARMUP_WINDOWS, reps=1, overrides=())
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    results: dict[str, dict[str, Any]] = {}
    ds_configs: dict[int, Path] = {}
    started = time.perf_counter()
    try:
        for name in names:
            stage, method, extra = VARIANTS[name]
            workload, extra = variant_overrides(name)
            if name == "lora_8b_zero3":
                extra = (*extra, *planned_lora_8b(torch.cuda.get_device_properties(0).total_memory))
            left = (deadline - time.perf_counter()) if deadline else 3600.0
            print(f"{name}: ZeRO-{stage} {' '.join(extra)}", flush=True)
            one = Setup(**{**setup.__dict__, "overrides": (*workload, *extra)})
            if left < EXPECTED_S.get(name, DEFAULT_EXPECTED_S):
                results[name] = {"skipped": f"not run: {left:.0f} s were left before the deadline"}
            elif method == "ds_exp":
                results[name] = measure_ds_exp(one, name, (), work, timeout=min(left, 900))
                if name == "ds_exp" and "ds_config" in results[name]:
                    ds_configs[stage] = Path(results[name]["ds_config"])
            elif stage not in ds_configs:
                results[name] = {"error": f"no ds_config.json: the ds_exp run at ZeRO-{stage} failed"}
            else:  # the bare loop and the Trainer train with the config ds_exp resolved
                script = "hf_trainer" if method.startswith("hf_trainer") else method
                recommended = ("--recommended",) if method == "hf_trainer_recommended" else ()
                cache, config = work / "data_cache", ds_configs[stage]
                try:  # pooled: one launch's windows as step_time_s / tokens_per_s, like ds_exp's
                    launch = measure_script(script, one, stage, 0, work, cache, config, recommended)
                    results[name] = pooled([launch])
                    results[name]["final_loss"] = launch.get("final_loss_rank0", launch.get("train_loss_mean"))
                except (RuntimeError, subprocess.TimeoutExpired) as err:  # one variant's failure is its result
                    results[name] = {"error": str(err)[-3000:]}
            print(f"  {describe(results[name])}", flush=True)
            write_result("gpu_throughput", summarize(results, gpus, device, setup))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    payload = summarize(results, gpus, device, setup)
    payload["total_wall_s"] = time.perf_counter() - started
    print(payload["table"])
    write_result("gpu_throughput", payload)
    return payload


def describe(result: dict[str, Any]) -> str:
    if "skipped" in result or "error" in result:
        return str(result.get("skipped") or result["error"][-500:])
    mfu = result.get("mfu")
    return f"{result.get('tokens_per_s') or 0:,.0f} tokens/s" + (f", MFU {mfu:.1%}" if mfu else "")


def summarize(results: dict[str, dict[str, Any]], gpus: int, device: str, setup: Setup) -> dict[str, Any]:
    """Both MFUs for the bare loop and the Trainer from ds_exp's FLOPs per token; ratios; the goals, met or not."""
    from ds_exp.train.flops import peak_flops

    peak = peak_flops(device, "bf16")
    reference = results.get("ds_exp_plain") or results.get("ds_exp") or {}
    per_token, ratio = reference.get("flops_per_token"), reference.get("flops_ratio_with_attention")
    for result in results.values():
        tokens = result.get("tokens_per_s")
        if result.get("mfu") is None and tokens and per_token and peak:
            result["mfu"] = tokens * per_token / gpus / peak
            result["mfu_with_attention"] = result["mfu"] * ratio if ratio else None

    def value(name: str, key: str) -> Any:
        return results.get(name, {}).get(key)

    trainer, default = value("hf_trainer_recommended", "tokens_per_s"), value("ds_exp", "tokens_per_s")
    fast, plain = value("ds_exp", "losses") or [], value("ds_exp_plain", "losses") or []
    loss_gap = max((abs(a - b) / abs(b) for a, b in zip(fast, plain, strict=False)), default=None)
    goal = {
        "targets": GOALS,
        "mfu": value("ds_exp", "mfu"),
        "ds_exp/Trainer_recommended_tokens_per_s": default / trainer if default and trainer else None,
        "lora_8b_mfu": value("lora_8b_zero3", "mfu"),
        "loss_vs_plain_max_relative_gap": loss_gap,
    }
    goal["met"] = bool(
        (goal["mfu"] or 0) >= GOALS["mfu"]
        and (goal["ds_exp/Trainer_recommended_tokens_per_s"] or 0) >= GOALS["vs_trainer"]
        and (goal["lora_8b_mfu"] or 0) >= GOALS["lora_8b_mfu"]
        and loss_gap is not None
        and loss_gap <= GOALS["loss_vs_plain"]
    )
    rows = []
    for name, result in results.items():
        step = (result.get("step_time_s") or {}).get("median")
        peaks = result.get("peak_memory_bytes_per_rank") or []
        rows.append(
            [
                name,
                step * 1e3 if step else None,
                result.get("tokens_per_s"),
                f"{result['mfu']:.1%}" if result.get("mfu") else None,
                f"{result['mfu_with_attention']:.1%}" if result.get("mfu_with_attention") else None,
                f"{max(p or 0 for p in peaks) / 2**30:.1f}" if peaks else None,
                result.get("compile_s"),
                result.get("final_loss"),
                result.get("skipped") or ("failed" if "error" in result else "ok"),
            ]
        )
    headers = ["variant", "ms/step", "tokens/s", "MFU (6N)", "MFU (6N+12Lds)", "peak GiB", "compile s", "loss", ""]
    return {
        "setup": {"gpus": gpus, "device": device, "workload": list(WORKLOAD), "lora_8b": list(LORA_8B)},
        "measured": {"steps": setup.steps, "window": setup.window, "warmup_windows": setup.warmup_windows},
        "peak_bf16_flops_per_gpu": peak,
        "mfu_counts": {
            "mfu": "ds_exp's: 6 N (input embedding excluded; LoRA 4 N + 2 N_trainable) + 12 L d sum(n_i^2) per example",
            "mfu_with_attention": "torchtitan's / llm-foundry's: 6 N + 12 L d s per token, s the row length",
        },
        "variants": results,
        "goal": goal,
        "table": table(headers, rows),
    }


def dry_run() -> dict[str, Any]:
    """On any machine: each variant's ds_exp config composed and validated as a CUDA run would be, its command line,
    and ds_exp's memory plan for an 80 GB GPU (what the 8B LoRA's micro batch comes from). Nothing is trained."""
    from ds_exp.config.memory_plan import human_bytes, run_estimate
    from ds_exp.launch.validation import validate
    from ds_exp.model.architecture import model_facts

    gpu_bytes = 80 * 10**9
    plan: dict[str, Any] = {}
    for name, (stage, method, extra) in VARIANTS.items():
        workload, extra = variant_overrides(name)
        if name == "lora_8b_zero3":
            extra = (*extra, *planned_lora_8b(gpu_bytes))
        overrides = (*workload, f"zero=stage{stage}", *extra)
        cfg = compose(*overrides)
        validate(cfg, accelerator="cuda")  # what a GPU's launch checks before anything heavy
        estimate = run_estimate(cfg, model_facts(cfg), world_size=1, precision="bf16", accelerator="cuda")
        module = {"ds_exp": "ds_exp", "bare": "bench.bare_loop"}.get(method, "bench.hf_trainer --recommended")
        plan[name] = {
            "runs": method,
            "command": f"torchrun --nproc_per_node 1 -m {module} " + " ".join(overrides),
            "estimate_per_gpu": human_bytes(estimate["estimate_bytes"]),
        }
        print(f"{name}: {plan[name]['command']}\n  memory plan per GPU: {plan[name]['estimate_per_gpu']}", flush=True)
    missing = [p for p in ("liger_kernel", "triton") if importlib.util.find_spec(p) is None]
    payload = {"gpu_bytes_planned_for": gpu_bytes, "variants": plan, "missing_packages_here": missing}
    write_result("gpu_throughput_dry_run", payload)
    return payload


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check every variant here, train nothing")
    parser.add_argument("--only", nargs="*", choices=tuple(VARIANTS), help="these variants only")
    args = parser.parse_args(sys.argv[1:])
    if args.dry_run:
        dry_run()
    else:
        main(names=tuple(args.only or VARIANTS))
