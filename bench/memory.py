"""Per-rank model-state memory at ZeRO 0-3 on 2 ranks (fp32, AdamW): measured, formula, estimators.

* measured: a real engine built as ds_exp builds it, one optimizer step on a real batch, under torchrun with
  2 ranks (`bench/memory_probe.py`, whose docstring says exactly what each count includes), on each rank:
  parameter, gradient (at the end of backward and kept for the step) and optimizer-state bytes, and the
  gradient reduce buckets apart (communication buffers, not model states).
* formula: the ZeRO paper's accounting for fp32 training with Adam, per rank with Psi parameters and
  N_d = 2: params 4 Psi (/N_d at stage 3), grads 4 Psi (/N_d from stage 2), optimizer states = Adam m and v
  (8 Psi) plus the fp32 master copy where DeepSpeed keeps one (4 Psi: at stages 1-3, see below), /N_d from
  stage 1. Stage 0 hands ds_exp's torch AdamW the model's own parameters: no master copy.
  DeepSpeed 0.19.8 clones the master partition at ZeRO 1/2 even in fp32 (stage_1_and_2.py,
  `weights_partition = ...clone()`). ZeRO 3 means to reuse the fp32 parameter partition instead
  (stage3.py, "we don't need another copy of the weights"), but its test compares `tensor.device` with the
  string `self.device` ('cpu', 'cuda:0'), which is never equal in torch 2.x, so it clones as well.
* DeepSpeed's estimators: `estimate_zero2_model_states_mem_needs_all_live` /
  `estimate_zero3_model_states_mem_needs_all_live` (num_gpus_per_node=2) print a table in GB with two
  decimals; their output is captured, and the exact per-GPU bytes of the no-offload line come from the
  functions those print from. They exist for stages 2 and 3 only and assume 16-bit mixed precision.
* ds_exp's dry run: `python -m ds_exp dry_run=true zero=stageN ...` with the environment torchrun gives
  rank 0 of 2 (RANK=0, WORLD_SIZE=2, ...), read from the `memory_per_rank` of <run dir>/plan.json. A real
  2-rank torchrun launch computes the same plan on both ranks, costs twice the time and leaves rank 1's
  Hydra placeholder directory (/tmp/ds_exp_rank1_*) behind.

Models: the default tiny model (`model=tiny`, 0.49M parameters) and a wider, deeper variant of it (about
13.9M parameters) where the MiB are large enough that padding and bucket effects become small.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import env, free_port, run, table, torchrun, write_result

WORLD = 2
STAGES = (0, 1, 2, 3)
COMMON = ("model=tiny", "precision=fp32", "data.synthetic.num_train=256")
VARIANTS: dict[str, tuple[str, ...]] = {
    "tiny": (),
    "tiny-wide": (
        "model.arch.hidden_size=512",
        "model.arch.intermediate_size=1536",
        "model.arch.num_hidden_layers=4",
        "model.arch.num_attention_heads=8",
        "model.arch.num_key_value_heads=8",
    ),
}
MiB = 2**20


def formula(stage: int, psi: int, n: int = WORLD) -> dict[str, float]:
    """ZeRO paper, fp32 + Adam, per rank; the master copy as DeepSpeed keeps it (stages 1-3)."""
    optimizer_per_param = 8 + (4 if stage >= 1 else 0)
    return {
        "params": 4 * psi / (n if stage >= 3 else 1),
        "grads": 4 * psi / (n if stage >= 2 else 1),
        "optimizer": optimizer_per_param * psi / (n if stage >= 1 else 1),
    }


def deepspeed_estimates(overrides: tuple[str, ...]) -> dict[str, Any]:
    """DeepSpeed's estimators on the plain (unpartitioned) model: their printed tables and exact bytes."""
    import torch
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs_all_live,
    )
    from deepspeed.runtime.zero.stage3 import model_to_params as zero3_params
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_live,
    )
    from transformers import AutoModelForCausalLM

    from bench.common import compose
    from ds_exp.model.architecture import build_model_config
    from ds_exp.model.tokenizer import load_tokenizer

    cfg = compose(*overrides)
    model = AutoModelForCausalLM.from_config(
        build_model_config(cfg.model, load_tokenizer(cfg.model, cfg.data)), dtype=torch.float32
    )
    printed = {}
    for stage, estimator in (
        (2, estimate_zero2_model_states_mem_needs_all_live),
        (3, estimate_zero3_model_states_mem_needs_all_live),
    ):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            estimator(model, num_gpus_per_node=WORLD)
        printed[stage] = buffer.getvalue()
    psi, largest = zero3_params(model)
    _, zero2_gpu = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=WORLD, cpu_offload=False)
    _, zero3_gpu, _ = estimate_zero3_model_states_mem_needs(
        psi, largest, num_gpus_per_node=WORLD, cpu_offload=False, cpu_offload_params=False, zero_init=True
    )
    return {"parameters": psi, "largest_layer": largest, "gpu_bytes": {2: zero2_gpu, 3: zero3_gpu}, "printed": printed}


def measure(work: Path, tag: str, stage: int, overrides: tuple[str, ...]) -> list[dict[str, Any]]:
    out = work / f"probe_{tag}_{stage}"
    cache = f"data.cache_dir={work / 'cache'}"
    run(torchrun(WORLD, "-m", "bench.memory_probe", str(out), f"zero=stage{stage}", *overrides, cache), cwd=work)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def dry_run(work: Path, tag: str, stage: int, overrides: tuple[str, ...]) -> dict[str, Any]:
    """`python -m ds_exp dry_run=true` as rank 0 of `torchrun --nproc_per_node 2` runs it (the dry run starts no
    process group: it reads the launch from the environment, and rank 1 would only repeat rank 0's work)."""
    import subprocess

    run_dir = work / f"dry_{tag}_{stage}"
    rank0 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD)}
    rank0.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-m", "ds_exp", "dry_run=true", f"zero=stage{stage}", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=work, env={**env(), **rank0}, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "plan.json").read_text())


def notes(stage: int, ranks: list[dict[str, Any]], form: dict[str, float], plan_mem: dict[str, int]) -> dict[str, str]:
    """Why the columns of each row differ (empty where they agree)."""
    r0 = ranks[0]
    out: dict[str, str] = {}
    pad = max(r["params"] - r["persistent_bytes"] for r in ranks) - form["params"]
    if stage == 3:
        out["params"] = (
            f"+{r0['persistent_bytes']:,} B of persistent parameters (fewer elements than "
            f"stage3_param_persistence_threshold={r0['persistence_threshold']}: kept whole on every rank)"
        )
    elif pad:
        out["params"] = f"flat buffer padded by {pad:,.0f} B for alignment"
    if stage == 1:
        out["grads_end"] = "ZeRO-1 does not partition gradients: every p.grad is whole when autograd ends"
    elif stage >= 2:
        pending = max(r["grads_end_of_backward"] - r["grads_for_step"] for r in ranks)
        out["grads_end"] = (
            f"+ up to {pending / MiB:.3g} MiB of p.grad not yet reduced (last bucket, reduced in the epilogue)"
        )
    if stage in (1, 2):
        out["grads_step"] = (
            "only the parameters overlapping this rank's partition keep gradients, each whole: a parameter that "
            "straddles the partition boundary is kept in full on both ranks"
        )
    elif stage == 3:
        out["grads_step"] = "grad_partitions_flat_buffer: exactly the partition, and it stays allocated after the step"
    if stage >= 1 and plan_mem["optimizer_bytes"] < form["optimizer"]:
        out["optimizer"] = (
            "ds_exp's dry run counts Adam m + v only (8 B/param); DeepSpeed also keeps an fp32 master "
            "partition (4 B/param / N_d) in fp32 training"
        )
    if stage >= 2:
        out["total"] = (
            "DeepSpeed's estimator assumes 16-bit mixed precision: 2 B/param of 16-bit params (ZeRO-3: 4 B x "
            "largest layer instead) + 18 B/param / N_d (16-bit and fp32 grads, fp32 master, Adam m, v)"
        )
    out["buckets"] = "reduce buckets (reduce_bucket_size elements, 2 with overlap_comm): not in any estimate"
    return out


def stage_rows(result: dict[str, Any]) -> list[list[Any]]:
    ranks, form, plan_mem, est, note = (
        result["measured"],
        result["formula"],
        result["ds_exp_dry_run"],
        result["deepspeed_estimator_bytes"],
        result["notes"],
    )

    def mib(value: float | None) -> float | None:
        return None if value is None else value / MiB

    def measured(key: str) -> list[float | None]:
        return [mib(r[key]) for r in ranks]

    totals = [r["params"] + max(r["grads_end_of_backward"], r["grads_for_step"]) + r["optimizer"] for r in ranks]
    return [
        ["params", *measured("params"), mib(form["params"]), None, mib(plan_mem["params_bytes"]), note.get("params")],
        [
            "grads, end of backward",
            *measured("grads_end_of_backward"),
            mib(form["grads"]),
            None,
            mib(plan_mem["grads_bytes"]),
            note.get("grads_end"),
        ],
        [
            "grads, kept for the step",
            *measured("grads_for_step"),
            mib(form["grads"]),
            None,
            mib(plan_mem["grads_bytes"]),
            note.get("grads_step"),
        ],
        [
            "optimizer states",
            *measured("optimizer"),
            mib(form["optimizer"]),
            None,
            mib(plan_mem["optimizer_bytes"]),
            note.get("optimizer"),
        ],
        [
            "total (params + larger grads + optimizer)",
            *[mib(t) for t in totals],
            mib(sum(form.values())),
            mib(est),
            mib(plan_mem["device_bytes"]),
            note.get("total"),
        ],
        ["reduce buckets", *measured("buckets"), None, None, None, note.get("buckets")],
    ]


def main(quick: bool = False) -> dict[str, Any]:
    variants = {"tiny": VARIANTS["tiny"]} if quick else VARIANTS
    payload: dict[str, Any] = {"world_size": WORLD, "precision": "fp32", "variants": {}}
    with tempfile.TemporaryDirectory(prefix="ds_exp_bench_memory_") as tmp:
        work = Path(tmp)
        for tag, extra in variants.items():
            overrides = (*COMMON, *extra)
            estimates = deepspeed_estimates(overrides)
            variant: dict[str, Any] = {"overrides": list(overrides), "deepspeed_estimator": estimates, "stages": {}}
            for stage in STAGES:
                ranks = measure(work, tag, stage, overrides)
                plan = dry_run(work, tag, stage, overrides)
                psi = ranks[0]["parameters"]
                if psi != estimates["parameters"] or psi != plan["parameters"]:
                    print(
                        f"warning: parameter counts differ: probe {psi}, estimator {estimates['parameters']}, "
                        f"dry run {plan['parameters']}"
                    )
                form = formula(stage, psi)
                result = {
                    "measured": ranks,
                    "formula": form,
                    "deepspeed_estimator_bytes": estimates["gpu_bytes"].get(stage),
                    "ds_exp_dry_run": plan["memory_per_rank"],
                    "dry_run_world_size": plan["world_size"],
                }
                result["notes"] = notes(stage, ranks, form, plan["memory_per_rank"])
                variant["stages"][stage] = result
            payload["variants"][tag] = variant

    headers = ["", "rank 0 MiB", "rank 1 MiB", "formula MiB", "DeepSpeed estimator MiB", "ds_exp dry run MiB", "note"]
    for tag, variant in payload["variants"].items():
        psi = variant["deepspeed_estimator"]["parameters"]
        print(f"\n## {tag}: {psi:,} parameters ({4 * psi / MiB:.3g} MiB in fp32), 2 ranks, fp32, AdamW\n")
        for stage, result in variant["stages"].items():
            print(f"### ZeRO {stage}\n")
            print(table(headers, stage_rows(result)))
            print()
        print("DeepSpeed's estimators printed (num_gpus_per_node=2):\n")
        for stage, text in variant["deepspeed_estimator"]["printed"].items():
            print(f"ZeRO {stage}:\n{text}")
    write_result("memory", payload)
    return payload


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
