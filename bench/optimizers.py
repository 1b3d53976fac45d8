"""The optimizers on the default model: `python -m ds_exp -m optimizer=adamw,adam,lion,adafactor,sgd,muon` with
nothing else changed (the tiny model on the embedded task, each optimizer with its YAML's defaults, the same data
order and schedule), one job after another in one process as a user's sweep runs, three times. Per optimizer:
tokens/s (the run's own, summary.json; the best of the three), the eval perplexity before and after, the wall
time, and what the memory planner counts for its state (ds_exp/config/memory_plan.py). The machine is shared: the
load average before and after is recorded, and tokens/s compare only within one run of this benchmark.

`--matrix` trains each optimizer a few steps at every ZeRO stage it supports, on 1 and 2 ranks, and with optimizer
offload where it supports it (lion's then compiles DeepSpeed's CPU Lion once), at one global batch: every run's
losses against the same optimizer's at ZeRO stage 0 on one rank (fp32: equal up to summation order), into
bench/results/optimizer_matrix.json.

`--lion-parity` also checks ds_exp's torch Lion against DeepSpeed's CPU Lion (compiled first: about a minute, once),
the comparison tests/unit/test_optimizers.py makes where that op is built.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import compose, run, table, torchrun, write_result

OPTIMIZERS = ("adamw", "adam", "lion", "adafactor", "sgd", "muon")  # adamw_8bit: CUDA and bitsandbytes only
QUICK = ("train.max_steps=20", "data.synthetic.num_train=512")


def planned_state(name: str) -> int:
    """The planner's optimizer-state bytes of the default model (beside the master weights)."""
    from ds_exp.config.memory_plan import optimizer_state
    from ds_exp.model.architecture import model_facts

    cfg = compose(f"optimizer={name}")
    facts = model_facts(cfg)
    return optimizer_state(cfg.optimizer, cfg.offload, cfg.lora, facts, "cpu").bytes(facts["trainable"])


def lion_parity() -> dict[str, Any]:
    import torch
    from deepspeed.ops.lion import DeepSpeedCPULion

    from ds_exp.model.lion import Lion

    torch.manual_seed(0)
    a = torch.randn(256, 128, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    ours = Lion([a], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    theirs = DeepSpeedCPULion([b], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for step in range(20):
        grad = torch.randn(256, 128, generator=torch.Generator().manual_seed(step))
        a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    return {"steps": 20, "max_abs_difference": float((a - b).abs().max()), "max_abs_value": float(a.abs().max())}


MATRIX_STEPS = (
    "train.max_steps=6",
    "train.log_every=1",
    "train.eval_at_start=false",
    "train.save_final_checkpoint=false",
)
MATRIX_COMMON = (*MATRIX_STEPS, "train.export=false", "data.synthetic.num_train=256", "data.synthetic.num_eval=32")


def matrix() -> None:
    """Every (optimizer, ZeRO stage, ranks, offload) an entry supports, a few steps each, against stage 0 on 1 rank."""
    from ds_exp.config.optimizers import OPTIMIZERS

    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in OPTIMIZERS:
            entry = OPTIMIZERS[name]
            if entry.cuda_only:
                continue
            cases = [(stage, ranks, "none") for stage in entry.zero_stages for ranks in (1, 2)]
            cases += [(2, 1, "cpu")] if entry.offload else []
            reference = None
            for stage, ranks, offload in cases:
                run_dir = Path(tmp) / f"{name}-{stage}-{ranks}-{offload}"
                overrides = [f"optimizer={name}", f"zero=stage{stage}", f"offload={offload}", *MATRIX_COMMON]
                overrides += ["train.gradient_clipping=0"] if entry.clip_note else []
                overrides += [f"train.micro_batch_size={4 // ranks}", f"hydra.run.dir={run_dir}"]
                args = ["-m", "ds_exp", *overrides]
                started = time.perf_counter()
                try:
                    run(torchrun(ranks, *args) if ranks > 1 else [sys.executable, *args], cwd=Path(tmp), timeout=1800)
                    error = None
                except RuntimeError as err:
                    error = str(err)[-600:]
                lines = (run_dir / "metrics.jsonl").read_text().splitlines() if error is None else []
                losses = [r["loss"] for r in map(json.loads, lines) if r["type"] == "train"]
                reference = losses if (stage, ranks, offload) == (0, 1, "none") else reference
                worst = max((abs(a - b) / abs(b) for a, b in zip(losses, reference or [], strict=False)), default=None)
                rows.append(
                    {
                        "optimizer": name,
                        "zero_stage": stage,
                        "ranks": ranks,
                        "offload": offload,
                        "losses": losses,
                        "max_relative_difference_to_stage0_1rank": worst,
                        "learns": bool(losses) and losses[-1] < losses[0],
                        "wall_s": time.perf_counter() - started,
                        "error": error,
                    }
                )
                print(name, stage, ranks, offload, error or worst, flush=True)
    headers = ["optimizer", "zero", "ranks", "offload", "max rel. diff. to stage 0 x 1", "learns", "error"]
    keys = ["optimizer", "zero_stage", "ranks", "offload", "max_relative_difference_to_stage0_1rank", "learns", "error"]
    print(table(headers, [[r[k] for k in keys] for r in rows]))
    payload = {"load_average_before": load_before, "load_average_after": os.getloadavg(), "runs": rows}
    print(write_result("optimizer_matrix", payload))


def sweep_once(overrides: list[str]) -> tuple[float, list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Path(tmp) / "sweep"
        wall, _ = run([sys.executable, "-m", "ds_exp", "-m", *overrides, f"hydra.sweep.dir={sweep}"], timeout=7200)
        summaries = [json.loads((sweep / str(n) / "summary.json").read_text()) for n in range(len(OPTIMIZERS))]
    return wall, summaries


def main(quick: bool = False, parity: bool = False, repeats: int = 3) -> None:
    """The sweep `repeats` times (the machine is shared: tokens/s is each optimizer's best of the repeats, the one
    other work disturbed least; the losses and perplexities are the same in every repeat, the runs deterministic)."""
    load_before = os.getloadavg()
    overrides = [f"optimizer={','.join(OPTIMIZERS)}", *(QUICK if quick else ())]
    sweeps = [sweep_once(overrides) for _ in range(repeats)]
    rows = []
    for number, name in enumerate(OPTIMIZERS):
        runs = [summaries[number] for _, summaries in sweeps]
        summary = runs[0]
        rows.append(
            {
                "optimizer": name,
                "built": summary["optimizer"],
                "status": summary["status"],
                "steps": summary["steps"],
                "tokens_per_s": max(r["tokens_per_s"] for r in runs),  # the least disturbed of the repeats
                "tokens_per_s_samples": [r["tokens_per_s"] for r in runs],
                "initial_perplexity": (summary["initial_eval"] or {}).get("perplexity"),
                "final_perplexity": (summary["final_eval"] or {}).get("perplexity"),
                "final_perplexity_same_in_every_repeat": len({r["final_eval"]["perplexity"] for r in runs}) == 1,
                "wall_time_s": statistics.median(r["wall_time_s"] for r in runs),
                "planned_state_bytes": planned_state(name),
            }
        )
    payload: dict[str, Any] = {
        "command": f"python -m ds_exp -m {' '.join(overrides)}",
        "repeats": repeats,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "sweep_wall_s": [wall for wall, _ in sweeps],
        "optimizers": rows,
    }
    if parity:
        payload["lion_torch_vs_deepspeed_cpu_lion"] = lion_parity()
    columns = {
        "optimizer": "optimizer",
        "built": "built",
        "steps": "steps",
        "tokens/s": "tokens_per_s",
        "ppl before": "initial_perplexity",
        "ppl after": "final_perplexity",
        "state bytes (planned)": "planned_state_bytes",
    }
    print(table(list(columns), [[r[key] for key in columns.values()] for r in rows]))
    name = "optimizers_quick" if quick else "optimizers"
    print(f"load average {load_before} -> {payload['load_average_after']}; {write_result(name, payload)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.optimizers", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 steps of each: a smoke run")
    parser.add_argument("--repeats", type=int, default=3, help="sweeps (tokens/s: the median; default 3)")
    parser.add_argument("--lion-parity", action="store_true", help="also compare torch Lion with DeepSpeed's CPU Lion")
    parser.add_argument(
        "--matrix", action="store_true", help="every ZeRO stage, 1 and 2 ranks, offload (not the sweep)"
    )
    args = parser.parse_args()
    if args.matrix:
        matrix()
    else:
        main(quick=args.quick, parity=args.lion_parity, repeats=args.repeats)
