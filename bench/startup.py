"""What ds_exp costs before training: launch to first optimizer step, and the commands that must stay light.

* Launch to first optimizer step of the tiny default (1 rank, warm data cache), against the floor of a bare
  Python process importing torch, deepspeed and transformers (the least any DeepSpeed HF run pays).
* `--help`, `--cfg job`, `dry_run=true` and the validation of a 16-job sweep: wall time, and which heavy
  modules (torch, deepspeed, transformers, datasets) each one imported, read from `sys.modules` at exit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import env, run, stats, table, write_result

HEAVY = ("torch", "deepspeed", "transformers", "datasets")

# Runs ds_exp's CLI (or a snippet) and, at exit, writes which heavy modules were imported.
_PROBE = """
import atexit, json, os, runpy, sys
heavy = {heavy!r}
def _dump():
    with open(os.environ["DS_EXP_BENCH_PROBE"], "w") as fh:
        json.dump(sorted(m for m in heavy if m in sys.modules), fh)
atexit.register(_dump)
"""

# `python -m ds_exp -m <sweep>` up to the end of its ValidateSweep callback (every job composed and validated,
# as before any job is launched), then exit: the launch itself is not part of the measure.
_VALIDATE_SWEEP_ONLY = """
import ds_exp.sweeps.jobs
_validate = ds_exp.sweeps.callbacks.ValidateSweep.on_multirun_start
def _validate_then_exit(self, config, **kwargs):
    _validate(self, config, **kwargs)
    sys.exit(0)
ds_exp.sweeps.callbacks.ValidateSweep.on_multirun_start = _validate_then_exit
"""

SWEEP_16 = ["-m", "zero=stage0,stage1,stage2,stage3", "precision=fp32,bf16", "lora.dim=0,64"]  # 4 x 2 x 2 jobs


def probed(code: str, argv: list[str], cwd: Path) -> tuple[float, list[str]]:
    """Wall time of `python -c PROBE+code` and the heavy modules it imported."""
    probe_file = cwd / "probe.json"
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=HEAVY) + code, *argv],
        cwd=cwd,
        env=env(DS_EXP_BENCH_PROBE=str(probe_file)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return elapsed, json.loads(probe_file.read_text())


def cli(args: list[str], cwd: Path, before: str = "") -> tuple[float, list[str]]:
    code = (
        before
        + "sys.argv = ['ds_exp', *sys.argv[1:]]\nrunpy.run_module('ds_exp', run_name='__main__', alter_sys=True)\n"
    )
    return probed(code, args, cwd)


def launch_to_first_step(cwd: Path, cache: Path, run_name: str) -> float:
    """Seconds from starting `python -m ds_exp` to its first optimizer step's metric line."""
    run_dir = cwd / run_name
    metrics = run_dir / "metrics.jsonl"
    args = [
        "train.max_steps=2",
        "train.log_every=1",
        "train.eval_at_start=false",
        "train.export=false",
        "train.save_final_checkpoint=false",
        f"data.cache_dir={cache}",
        f"hydra.run.dir={run_dir}",
    ]
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ds_exp", *args],
        cwd=cwd,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    first_step = None
    while proc.poll() is None and first_step is None:
        if metrics.is_file() and '"type": "train"' in metrics.read_text():
            first_step = time.perf_counter() - started
        time.sleep(0.01)
    _, stderr = proc.communicate(timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"ds_exp failed:\n{stderr[-3000:]}")
    if first_step is None:  # ended between two polls: the line is there now
        first_step = time.perf_counter() - started
    return first_step


def main(quick: bool = False) -> dict[str, Any]:
    reps = 2 if quick else 3
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ds_exp_bench_startup_") as tmp:
        work = Path(tmp)
        cache = work / "cache"
        run(
            [
                sys.executable,
                "-m",
                "ds_exp",
                "train.max_steps=1",
                "train.export=false",
                f"data.cache_dir={cache}",
                f"hydra.run.dir={work / 'warmup'}",
            ],
            cwd=work,
        )  # builds the data cache and DeepSpeed's CPU op
        floor = [run([sys.executable, "-c", "import torch, deepspeed, transformers"], cwd=work)[0] for _ in range(reps)]
        first = [launch_to_first_step(work, cache, f"first_step_{i}") for i in range(reps)]
        results["launch"] = {"import_floor_s": stats(floor), "launch_to_first_step_s": stats(first)}

        commands: dict[str, Any] = {}
        for name, args in (
            ("--help", ["--help"]),
            ("--cfg job", ["--cfg", "job"]),
            ("dry_run=true", ["dry_run=true", f"hydra.run.dir={work / 'dry'}"]),
        ):
            timed = [cli(args, work) for _ in range(reps)]
            commands[name] = {"wall_s": stats([t for t, _ in timed]), "heavy_imports": timed[-1][1]}
        sweep_dir = f"hydra.sweep.dir={work / 'sweep'}"
        timed = [cli([*SWEEP_16, sweep_dir], work, before=_VALIDATE_SWEEP_ONLY) for _ in range(reps)]
        commands["validate a 16-job sweep"] = {"wall_s": stats([t for t, _ in timed]), "heavy_imports": timed[-1][1]}
        results["commands"] = commands

    launch = results["launch"]
    print(
        table(
            ["measure", "median s", "min s", "max s"],
            [
                ["import torch + deepspeed + transformers (floor)", *_mmm(launch["import_floor_s"])],
                ["ds_exp launch to first optimizer step (tiny, 1 rank)", *_mmm(launch["launch_to_first_step_s"])],
                *[[f"`python -m ds_exp {k}`", *_mmm(v["wall_s"])] for k, v in commands.items()],
            ],
        )
    )
    print()
    print(
        table(
            ["command", "heavy modules imported"],
            [[k, ", ".join(v["heavy_imports"]) or "none"] for k, v in commands.items()],
        )
    )
    write_result("startup", results)
    return results


def _mmm(s: dict[str, float]) -> list[float]:
    return [s["median"], s["min"], s["max"]]


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
