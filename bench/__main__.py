"""`python -m bench`: ds_exp's benchmarks, one after another; each prints its table and writes
bench/results/<name>.json. The CPU set runs anywhere; gpu_throughput runs on CUDA and says it skipped
elsewhere. `python -m bench --quick` is a short smoke run; `python -m bench step_time memory` runs only those.
These measure; they assert nothing (the tests do that)."""

from __future__ import annotations

import argparse
import importlib
import time

BENCHMARKS = {
    "startup": "launch to first step, and the light commands (--help, --cfg job, dry run, sweep validation)",
    "help_time": "`python -m ds_exp --help` vs a bare Hydra app's --help, paired whole processes (bar: 2x)",
    "step_time": "steady-state step time: ds_exp vs a bare DeepSpeed loop vs HF Trainer, ZeRO 0-3, 2 ranks",
    "step_overhead": "ds_exp's per-step overhead over a bare step, paired in the same processes, ZeRO 0-3",
    "tokenize_data": "tokenization of 100k examples, cold and cached, vs a bare datasets.map; peak memory",
    "optimizers": "each optimizer on the default model, one sweep: tokens/s, perplexity before and after",
    "memory": "per-rank parameter, gradient and optimizer-state bytes at ZeRO 0-3 vs formulas and estimators",
    "harness_time": "eval.harness (ds_exp_synthetic, ds_exp_passkey) on the default run against its training time",
    "long_context": "the longest sequence under one per-rank budget, ALST's techniques added in turn (~30+ minutes)",
    "gpu_throughput": "CUDA only (skipped without): tokens/s, both MFUs: 1.1B fast vs plain vs Trainer, 8B LoRA",
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions: a smoke run")
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    started = time.perf_counter()
    for name in args.names or list(BENCHMARKS):
        print(f"\n## {name}: {BENCHMARKS[name]}\n", flush=True)
        t0 = time.perf_counter()
        importlib.import_module(f"bench.{name}").main(quick=args.quick)
        print(f"\n({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\nall benchmarks: {time.perf_counter() - started:.0f} s; results in bench/results/")


if __name__ == "__main__":
    main()
