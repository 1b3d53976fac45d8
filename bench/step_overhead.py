"""ds_exp's per-step overhead over a bare DeepSpeed step, paired: in the same 2 ranks and on the same engine,
steps alternate between ds_exp's loop step and the bare step, so that launch-to-launch luck (which core a
rank lands on, memory layout) and the machine's slow spells hit both alike.

    python -m bench step_overhead        # 2 CPU ranks under torchrun, ZeRO 0-3, one launch per stage

* ds_exp step: `Loop.optimizer_step` (ds_exp/train/loop.py) exactly as the loop calls it (its one all-reduce of label
tokens
  and votes, the loss over the global batch's label tokens, bookkeeping, progress bar, and a metric line
  every WINDOW ds_exp steps with its all-reduce, grad norm and JSON line).
* bare step: forward with the model's own loss, `engine.backward`, `engine.step`, nothing else.
Both fetch their micro batches inside the timed step from the same DataLoader. Steps alternate
ds_exp, bare, ds_exp, ...; the first WARMUP pairs are dropped. bench/step_time.py measures whole launches
(ds_exp vs bare loop vs Trainer, separate processes): its ratios carry the launch-to-launch spread of this
2-core machine (several percent), which this pairing removes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import run, stats, table, torchrun, write_result

NPROC, STAGES, PAIRS, WARMUP, WINDOW, MICRO_BATCH = 2, (0, 1, 2, 3), 150, 20, 5, 16


def worker(stage: int, pairs: int, out: Path, cache: Path) -> None:
    """One rank: ds_exp's recipe up to its loop (ds_exp.train.recipe.setup), then its loop step alternated with the bare
    step."""
    import torch
    from torch.utils.data import DataLoader

    from bench.workload import compose
    from ds_exp.checkpoint.checkpointer import Checkpointer
    from ds_exp.resume.store import TrainState
    from ds_exp.train.evaluate import Generations
    from ds_exp.train.hooks import Run, RunHooks
    from ds_exp.train.loop import Loop, Progress
    from ds_exp.train.metrics import Metrics
    from ds_exp.train.recipe import setup
    from ds_exp.train.sampler import ResumableDistributedSampler
    from ds_exp.train.session import Session
    from ds_exp.train.step import model_inputs

    steps = 2 * pairs
    cfg = compose(
        [
            f"zero=stage{stage}",
            f"train.micro_batch_size={MICRO_BATCH}",
            f"train.max_steps={steps + 1}",  # never the last step: that one always writes a metric line
            f"train.log_every={WINDOW}",
            "train.eval_every=0",
            "train.save_every=0",
            f"data.cache_dir={cache}",
            f"data.synthetic.num_train={MICRO_BATCH * NPROC * (steps + 8)}",  # one epoch: no epoch-end eval
        ]
    )
    run_dir = Path(tempfile.mkdtemp(prefix="ds_exp_overhead_"))
    with Session(cfg, run_dir) as session:
        session.start()
        work = setup(cfg, session)
        metrics_log, trackers = session.open_sinks(TrainState())
        metrics = Metrics(metrics_log, trackers, device=work.engine.device, world_size=session.world, peak_flops=None)
        metrics.show_progress(work.total_steps, 0, session.is_main)
        checkpoints = Checkpointer(
            work.engine,
            run_dir / "checkpoints",
            rank=session.rank,
            keep_last=1,
            needed_bytes=0,
            identity={"run_id": "bench"},
        )
        generations = Generations(
            [], tokenizer=work.tokenizer, template="dschat", max_new_tokens=1, stop_ids=[], path=run_dir / "g.jsonl"
        )
        run = Run(session, RunHooks([]), work, metrics=metrics)
        loop = Loop(cfg.train, cfg.eval, session, work, metrics, checkpoints, generations, Progress(0, 0, 0), run)
        sampler = ResumableDistributedSampler(
            len(work.data.train), rank=session.rank, world_size=session.world, seed=0, shuffle=True, drop_last=True
        )
        loader = iter(DataLoader(work.data.train, batch_size=MICRO_BATCH, sampler=sampler, collate_fn=work.collator))
        engine = work.engine
        times: dict[str, list[float]] = {"ds_exp": [], "bare": []}
        for i in range(steps):
            started = time.perf_counter()
            batch = next(loader)
            if i % 2 == 0:
                loop.optimizer_step([batch], started)
                times["ds_exp"].append(time.perf_counter() - started)
            else:
                batch = {k: v.to(engine.device) for k, v in batch.items()}
                loss = engine(**model_inputs(batch), labels=batch["labels"], use_cache=False).loss
                engine.backward(loss)
                engine.step()
                times["bare"].append(time.perf_counter() - started)
        metrics.write()
        metrics.close_progress()
        if session.rank == 0:
            out.write_text(json.dumps({"stage": stage, "threads": torch.get_num_threads(), **times}) + "\n")


def measure(stage: int, pairs: int, work: Path, cache: Path) -> dict[str, Any]:
    out = work / f"stage{stage}.json"
    cmd = torchrun(NPROC, "-m", "bench.step_overhead", "--worker", "--stage", str(stage), "--pairs", str(pairs))
    run([*cmd, "--out", str(out), "--cache", str(cache)], cwd=work, timeout=900)
    result = json.loads(out.read_text())
    ds_exp, bare = result["ds_exp"][WARMUP:], result["bare"][WARMUP:]
    diffs = [a - b for a, b in zip(ds_exp, bare, strict=True)]  # each ds_exp step minus the bare step after it
    ds_med, bare_med = statistics.median(ds_exp), statistics.median(bare)
    return {
        "ds_exp_s": stats(ds_exp),
        "bare_s": stats(bare),
        "paired_difference_s": stats(diffs),
        "ratio_of_medians": ds_med / bare_med,
        "overhead_ms": statistics.median(diffs) * 1e3,
        "overhead_pct": 100 * statistics.median(diffs) / bare_med,
        "torch_threads": result["threads"],
        "samples": {"ds_exp": result["ds_exp"], "bare": result["bare"]},
    }


def main(quick: bool = False) -> dict[str, Any]:
    stages, pairs = ((0,), 40) if quick else (STAGES, PAIRS)
    started = time.perf_counter()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as tmp:
        work = Path(tmp)
        for stage in stages:
            print(f"ZeRO-{stage}: {pairs} pairs of steps (ds_exp, bare), 2 ranks", flush=True)
            results[str(stage)] = measure(stage, pairs, work, work / "cache")
    rows = [
        [
            stage,
            r["ds_exp_s"]["median"] * 1e3,
            r["bare_s"]["median"] * 1e3,
            r["overhead_ms"],
            f"{r['paired_difference_s']['q1'] * 1e3:.2f} to {r['paired_difference_s']['q3'] * 1e3:.2f}",
            r["overhead_pct"],
        ]
        for stage, r in results.items()
    ]
    headers = [
        "ZeRO stage",
        "ds_exp step ms (median)",
        "bare step ms (median)",
        "overhead ms (median of paired differences)",
        "paired differences IQR ms",
        "overhead % of the bare step (target <= 2)",
    ]
    text = table(headers, rows)
    print(text)
    payload = {
        "setup": {
            "nproc_per_node": NPROC,
            "micro_batch_size": MICRO_BATCH,
            "pairs": pairs,
            "warmup_pairs_dropped": WARMUP,
            "metric_line_every": WINDOW,
            "quick": quick,
        },
        "stages": results,
        "table": text,
        "total_wall_s": time.perf_counter() - started,
    }
    write_result("step_overhead_quick" if quick else "step_overhead", payload)
    return payload


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=PAIRS)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cache", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.stage, args.pairs, args.out, args.cache)
    else:
        main(quick=args.quick)
    sys.exit(0)
