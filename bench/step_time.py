"""Steady-state optimizer-step time of ds_exp against a bare DeepSpeed loop (the floor) and Hugging Face's
Trainer, with the same model, data, micro batches and DeepSpeed config, 2 CPU ranks under torchrun, ZeRO 0-3.

    python -m bench.step_time            # the benchmark (12 launches, about 4 minutes on 2 cores)
    python -m bench.step_time --before 3fc6147 --stages 0 2   # also ds_exp at an earlier commit
    python -m bench.step_time --quick    # smoke run: stage 0, few steps (bench/results/step_time_quick.json)

For each stage, in this order (never two multi-process jobs at once):
1. ds_exp: `torchrun -m ds_exp zero=stageN train.max_steps=S train.log_every=W ...`; every metric line's
   step_time_s (mean wall seconds per optimizer step over its W steps) is one window. Its ds_config.json is
   the exact dict ds_exp handed to deepspeed.initialize, and the two others train with that file.
2. bench/bare_loop.py: forward, engine.backward, engine.step and nothing else, same optimizer and schedule.
3. bench/hf_trainer.py: transformers.Trainer (DeepSpeed on CPU: see its docstring for what that needs).
The first WARMUP_WINDOWS windows are dropped; the per-step times of (2) and (3) are grouped in windows of W
steps like ds_exp's, and each method's result is the median (and spread: interquartile range, min, max)
over its remaining windows. Tokens/s counts input tokens of all ranks (the batches are the same for all three).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, run, stats, table, torchrun, write_result

NPROC = 2
MICRO_BATCH = 16  # ds_exp's default: ~0.1 s steps on 2 cores, well above timer and scheduling noise
STAGES = (0, 1, 2, 3)
# Each launch spends ~15-20 s starting up (imports, rendezvous, data, model, engine) on this 2-core machine;
# 60 steps of ~0.05-0.2 s leave 10 windows of 5 steps after warm-up (the first 10 steps run slower: allocator
# and autograd caches, DeepSpeed's first steps). Launches vary by several percent from one to the next on a
# 2-core machine (which core a rank lands on, the machine's slow spells): REPS > 1 launches each method REPS
# times, interleaved (ds_exp, bare, Trainer, ds_exp, ...), and pools their windows; the default of 1 keeps
# `python -m bench` within 15 minutes, and bench/step_overhead.py pairs steps within one launch instead.
STEPS, WINDOW, WARMUP_WINDOWS, REPS = 60, 5, 2, 1
QUICK_STAGES, QUICK_STEPS = (0,), 15
METHODS = ("ds_exp", "bare", "hf_trainer")
SCRIPTS = {"bare": "bench.bare_loop", "hf_trainer": "bench.hf_trainer"}
LABELS = {"ds_exp": "ds_exp", "bare": "bare DeepSpeed loop", "hf_trainer": "HF Trainer + DeepSpeed"}
TARGETS = {"ds_exp/bare": 1.02, "ds_exp/Trainer": 1.0}
PLOT = REPO / "docs" / "bench_step_time.png"


@dataclass(frozen=True)
class Setup:
    """One comparison: how many ranks, how long, and the ds_exp overrides that pick model, data and batch."""

    nproc: int = NPROC
    steps: int = STEPS
    window: int = WINDOW
    warmup_windows: int = WARMUP_WINDOWS
    reps: int = REPS
    overrides: tuple[str, ...] = (f"train.micro_batch_size={MICRO_BATCH}",)
    # a checkout of an earlier ds_exp to time beside this one ("ds_exp_before"): the before of a speed-up
    before_src: Path | None = None


def shared_overrides(setup: Setup, stage: int, cache_dir: Path) -> list[str]:
    """What all three compose: the model, data, batch and schedule of the run."""
    return [
        f"zero=stage{stage}",
        f"train.max_steps={setup.steps}",
        f"train.log_every={setup.window}",
        f"data.cache_dir={cache_dir}",
        *setup.overrides,
    ]


def ds_exp_overrides(steps: int, run_dir: Path) -> list[str]:
    """Only what keeps the ds_exp run lean: no evaluation before or inside the timed steps (the one eval is at
    step S, after the last metric line), no checkpoint, no export."""
    return [
        "train.eval_at_start=false",
        f"train.eval_every={steps}",
        "train.export=false",
        "train.save_final_checkpoint=false",
        f"hydra.run.dir={run_dir}",
    ]


def windows(step_times: Sequence[float], window: int) -> list[float]:
    """Mean step time of each complete window of `window` consecutive steps."""
    return [sum(step_times[i : i + window]) / window for i in range(0, len(step_times) - window + 1, window)]


def window_tokens_per_s(step_times: Sequence[float], tokens: Sequence[int], window: int) -> list[float]:
    return [
        sum(tokens[i : i + window]) / sum(step_times[i : i + window])
        for i in range(0, len(step_times) - window + 1, window)
    ]


def median(values: Sequence[float]) -> float | None:
    return stats(values).get("median") if values else None


def measure_ds_exp(
    setup: Setup, stage: int, rep: int, work: Path, cache: Path, src: Path = REPO, name: str = "ds_exp"
) -> dict[str, Any]:
    """One launch of ds_exp (from the checkout `src`); every metric line's step_time_s (wall time per optimizer
    step between two metric lines) is one window."""
    run_dir = work / f"{name}_stage{stage}_rep{rep}"
    overrides = [*shared_overrides(setup, stage, cache), *ds_exp_overrides(setup.steps, run_dir)]
    cmd = torchrun(setup.nproc, "-m", "ds_exp", *overrides)
    wall, _ = run(cmd, cwd=work, timeout=600, PYTHONPATH=str(src))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["type"] == "train"][setup.warmup_windows :]
    return {
        "launch_wall_s": wall,
        "windows_s": [r["step_time_s"] for r in train],
        "window_tokens_per_s": [r["tokens_per_s"] for r in train],
        "final_loss": train[-1]["loss"] if train else None,
        "ds_config": run_dir / "ds_config.json",
    }


def measure_script(
    method: str,
    setup: Setup,
    stage: int,
    rep: int,
    work: Path,
    cache: Path,
    ds_config: Path,
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """One launch of bench/bare_loop.py or bench/hf_trainer.py; its per-step times grouped like ds_exp's."""
    tag = "_".join(a.strip("-") for a in extra_args)
    out = work / f"{method}{'_' + tag if tag else ''}_stage{stage}_rep{rep}.json"
    args = ["--ds-config", str(ds_config), "--steps", str(setup.steps), "--out", str(out), *extra_args, "--"]
    cmd = torchrun(setup.nproc, "-m", SCRIPTS[method], *args, *shared_overrides(setup, stage, cache))
    started = time.perf_counter()
    try:
        wall, _ = run(cmd, cwd=work, timeout=600)
    except RuntimeError as err:
        if method != "hf_trainer":
            raise
        # the Trainer's failure is its result; the script writes the exception when it got that far
        written = json.loads(out.read_text()).get("error") if out.exists() else None
        return {"launch_wall_s": time.perf_counter() - started, "error": written or str(err)[-2000:]}
    result = json.loads(out.read_text())
    if method == "hf_trainer" and not (result["deepspeed_enabled"] and result["zero_stage"] == stage):
        facts = {k: v for k, v in result.items() if not isinstance(v, list)}
        return {"launch_wall_s": wall, "error": f"Trainer did not train with DeepSpeed ZeRO-{stage}: {facts}"}
    times, tokens = result["step_times_s"], result["tokens_per_step"]
    skip = setup.warmup_windows * setup.window
    measured = {
        "launch_wall_s": wall,
        "windows_s": windows(times[skip:], setup.window),
        "window_tokens_per_s": window_tokens_per_s(times[skip:], tokens[skip:], setup.window),
        "optimizer": result["optimizer"],
        "torch_threads": result["torch_threads"],
    }
    if method == "hf_trainer":
        measured["begin_to_end_s"] = windows(result["step_begin_to_end_s"][skip:], setup.window)
        measured["train_loss_mean"] = result["train_loss"]
    else:
        measured["final_loss_rank0"] = result["last_micro_batch_loss"][-1]
    return measured


def pooled(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """A method's result over its launches: the windows of all launches pooled; a failed launch fails it."""
    failed = [launch for launch in launches if "error" in launch]
    if failed:
        return {"error": failed[0]["error"], "launches": launches}
    all_windows = [w for launch in launches for w in launch["windows_s"]]
    return {
        "step_time_s": stats(all_windows),
        "tokens_per_s": median([t for launch in launches for t in launch["window_tokens_per_s"]]),
        "launch_medians_s": [median(launch["windows_s"]) for launch in launches],
        "launches": launches,
    }


def measure_stage(setup: Setup, stage: int, work: Path, cache: Path) -> dict[str, Any]:
    """All methods, `setup.reps` launches each, interleaved so that slow spells of the machine hit all three."""
    methods = (*METHODS, "ds_exp_before") if setup.before_src else METHODS
    launches: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    ds_config: Path | None = None
    for rep in range(setup.reps):
        first = measure_ds_exp(setup, stage, rep, work, cache)
        written = first.pop("ds_config")
        ds_config = ds_config or written  # every ds_exp launch resolves the same config
        launches["ds_exp"].append(first)
        for method in ("bare", "hf_trainer"):
            launches[method].append(measure_script(method, setup, stage, rep, work, cache, ds_config))
        if setup.before_src:
            before = measure_ds_exp(setup, stage, rep, work, cache, setup.before_src, "ds_exp_before")
            before.pop("ds_config")
            launches["ds_exp_before"].append(before)
    assert ds_config is not None
    res: dict[str, Any] = {m: pooled(launches[m]) for m in methods}
    if setup.before_src:
        res["ds_exp_before/bare"] = ratio(res["ds_exp_before"], res["bare"])
    res["ds_config"] = json.loads(ds_config.read_text())
    res["ds_exp/bare"] = ratio(res["ds_exp"], res["bare"])
    res["ds_exp/Trainer"] = ratio(res["ds_exp"], res["hf_trainer"])
    return res


def ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    top, bottom = a.get("step_time_s", {}).get("median"), b.get("step_time_s", {}).get("median")
    return top / bottom if top and bottom else None


def ms_cell(result: dict[str, Any]) -> str:
    if "error" in result or not result["step_time_s"].get("n"):
        return "failed" if "error" in result else "no windows"
    s = result["step_time_s"]
    return f"{s['median'] * 1e3:.1f} ({s['q1'] * 1e3:.1f}-{s['q3'] * 1e3:.1f})"


def make_table(stages: dict[str, dict[str, Any]]) -> str:
    rows = []
    for stage, res in stages.items():
        rows.append(
            [
                stage,
                *(ms_cell(res[m]) for m in METHODS),
                res["ds_exp/bare"],
                res["ds_exp/Trainer"],
                *(round(res[m]["tokens_per_s"]) if res[m].get("tokens_per_s") else None for m in METHODS),
            ]
        )
    headers = [
        "ZeRO stage",
        "ds_exp ms/step (IQR)",
        "bare ms/step (IQR)",
        "Trainer ms/step (IQR)",
        f"ds_exp/bare (target <= {TARGETS['ds_exp/bare']})",
        f"ds_exp/Trainer (target <= {TARGETS['ds_exp/Trainer']})",
        "ds_exp tokens/s",
        "bare tokens/s",
        "Trainer tokens/s",
    ]
    return table(headers, rows)


def plot(stages: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """Median step time per stage for the three, interquartile range as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.27
    names = list(stages)
    for i, method in enumerate(METHODS):
        xs, ys, low, high = [], [], [], []
        for j, stage in enumerate(names):
            s = stages[stage][method].get("step_time_s")
            x = j + (i - 1) * width
            if not s:
                ax.text(x, 0, "failed", rotation=90, ha="center", va="bottom", fontsize=8)
                continue
            xs.append(x)
            ys.append(s["median"] * 1e3)
            low.append((s["median"] - s["q1"]) * 1e3)
            high.append((s["q3"] - s["median"]) * 1e3)
        ax.bar(xs, ys, width, yerr=[low, high], capsize=3, label=LABELS[method])
    ax.set_xticks(range(len(names)), [f"ZeRO-{s}" for s in names])
    ax.set_ylabel("ms per optimizer step (median, IQR bars)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def compare(setup: Setup, stages: Sequence[int], *, describe: dict[str, Any]) -> dict[str, Any]:
    """Measure every stage (see measure_stage); returns the payload with its table."""
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench_step_time_"))
    cache = work / "data_cache"  # tokenized once by the first launch, read by the rest
    results: dict[str, dict[str, Any]] = {}
    try:
        for stage in stages:
            print(f"ZeRO-{stage}: ds_exp, bare loop, Trainer ({setup.reps} x {setup.steps} steps each)", flush=True)
            results[str(stage)] = measure_stage(setup, stage, work, cache)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = make_table(results)
    print(text)
    return {
        "setup": {
            "nproc_per_node": setup.nproc,
            "overrides": list(setup.overrides),
            "steps_per_launch": setup.steps,
            "launches_per_method": setup.reps,
            "window_steps": setup.window,
            "warmup_windows_dropped": setup.warmup_windows,
            "statistic": "median over the pooled windows (mean step time of W steps) of all launches of a method; "
            "spread = IQR, min, max",
            **describe,
        },
        "targets": TARGETS,
        "stages": results,
        "table": text,
        "total_wall_s": time.perf_counter() - started,
    }


def main(quick: bool = False) -> dict[str, Any]:
    """Run the 3 methods for each stage, print the table, write bench/results/step_time.json (quick: _quick,
    plot in bench/results) and docs/bench_step_time.png; returns the payload."""
    setup = Setup(steps=QUICK_STEPS, warmup_windows=1, reps=1) if quick else Setup()
    payload = compare(
        setup,
        QUICK_STAGES if quick else STAGES,
        describe={
            "model": "tiny (conf/model/tiny.yaml)",
            "data": "synthetic (conf/data/synthetic.yaml)",
            "quick": quick,
        },
    )
    name = "step_time_quick" if quick else "step_time"
    path = write_result(name, payload)
    title = (
        f"ds_exp vs bare DeepSpeed vs HF Trainer, {setup.nproc} CPU ranks, micro batch {MICRO_BATCH}, "
        f"{setup.reps} x {setup.steps} steps"
    )
    plot(payload["stages"], RESULTS / f"{name}.png" if quick else PLOT, title)
    print(f"wrote {path} in {payload['total_wall_s']:.0f}s")
    return payload


def before_and_after(ref: str, stages: Sequence[int]) -> dict[str, Any]:
    """ds_exp at git `ref` beside this checkout, the bare loop and the Trainer, interleaved: the before and
    after of a speed-up (bench/results/step_time_before_after.json)."""
    with tempfile.TemporaryDirectory(prefix="ds_exp_before_") as tmp:
        src = Path(tmp) / "src"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(src), ref], check=True)
        try:
            payload = compare(Setup(before_src=src), stages, describe={"before": ref, "after": "this checkout"})
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(src)], check=False)
    for stage, res in payload["stages"].items():
        print(f"ZeRO-{stage}: before/bare {res['ds_exp_before/bare']:.3f}, after/bare {res['ds_exp/bare']:.3f}")
    write_result("step_time_before_after", payload)
    return payload


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stage 0 only, few steps (smoke run)")
    parser.add_argument("--before", metavar="GIT_REF", help="also time ds_exp at GIT_REF (the before of a speed-up)")
    parser.add_argument("--stages", type=int, nargs="*", default=list(STAGES), help="with --before: stages to time")
    args = parser.parse_args()
    if args.before:
        before_and_after(args.before, args.stages)
    else:
        main(quick=args.quick)
