"""One command that checks a CUDA machine with ds_exp installed, and writes bench/results/gpu_check.json.

    python -m bench.gpu_check            # GPU tests, the user's lines, the throughput benchmark (~25 minutes)
    python -m bench.gpu_check --quick    # the same with the quick throughput set (~12 minutes)
    python -m bench.gpu_check --quick --jobs 4 --deadline-s 500 --skip long_context   # a 15-minute GPU lease

--jobs N deals the GPU tests to N pytest processes and runs the user's lines N at a time, all side by side (their
wall times are then not timings: the throughput benchmark, which runs alone, is); --deadline-s stops starting work
past that many seconds and records what did not run; the results file is rewritten after each part, so a run
stopped from outside keeps what it finished.

1. `pytest -m gpu` (tests/system/test_gpu.py, and the fp16 fault test): each test's outcome.
2. The user's line and its neighbours, each a short run on every GPU (torchrun, one rank per GPU), the first
   launch with an empty torch extension cache and Hopper's TORCH_CUDA_ARCH_LIST=9.0a: ZeRO 0-3 in bf16 and in
   fp16, precision=auto (must pick bf16), LoRA, optimizer offload (compiles DeepSpeed's CPU Adam, and says so),
   parameter offload. Each records status, wall time, whether an op was compiled, losses, skipped steps, MFU.
3. bench/gpu_throughput.py (tokens/s and MFU of a 1.1B Llama: ds_exp vs bare DeepSpeed vs the Trainer).
4. Long context (bench/long_context.py's gpu_main): a 1.03B Llama's longest sequence that trains one step, and its
   tokens/s, on flash-attention's varlen path (packed rows): baseline, experiment=long_context, and with Ulysses
   sequence parallelism over every GPU where there are several. Written, not yet run (no GPU in that session).
A bare GPU machine needs ds_exp's dependencies first: bench/gpu_setup.sh says how (no network needed there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import REPO, env, free_port, write_result

STEPS = 30
LINES: dict[str, tuple[str, ...]] = {
    **{f"zero{s}_bf16": (f"zero=stage{s}", "precision=bf16") for s in range(4)},
    **{f"zero{s}_fp16": (f"zero=stage{s}", "precision=fp16") for s in range(4)},
    "users_line": ("zero=stage3", "precision=bf16", "lora.dim=64"),
    "precision_auto": ("precision=auto",),
    "lora_zero2": ("zero=stage2", "precision=bf16", "lora.dim=64"),
    "offload_optimizer": ("zero=stage2", "precision=bf16", "offload=cpu"),
    "offload_all": ("zero=stage3", "precision=bf16", "offload=cpu_all"),
}


# The files holding `gpu` tests (tests/unit/test_structure.py keeps this list whole): collecting only these keeps the
# dev-only packages the other test files import (gguf, optuna, mlflow, tensorboard) off a bare GPU machine.
GPU_TEST_FILES = ("tests/system/test_gpu.py", "tests/integration/test_faults.py")


def run_pytest(work: Path, timeout: float, shards: int = 1) -> dict[str, Any]:
    """`pytest -m gpu`, its tests dealt round-robin to `shards` pytest processes run side by side."""
    started = time.perf_counter()
    base = [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-p", "no:cacheprovider"]  # the shards: no xdist
    # no test zygote: a process forked after CUDA's driver was initialized (DeepSpeed asks at import) cannot use it
    test_env = env(DS_EXP_NO_ZYGOTE="1")
    listed = subprocess.run(
        [*base, "--collect-only", "-q", *GPU_TEST_FILES], cwd=REPO, env=test_env, capture_output=True, text=True
    )
    node_ids = [line for line in listed.stdout.splitlines() if "::" in line]
    if not node_ids:
        return {"returncode": listed.returncode, "outcomes": {}, "tail": (listed.stdout + listed.stderr)[-6000:]}

    def shard(index: int) -> tuple[int | None, str, dict[str, str]]:
        junit = work / f"gpu_tests_{index}.xml"
        try:
            proc = subprocess.run(
                [*base, "-q", "-rA", f"--junitxml={junit}", *node_ids[index::shards]],
                cwd=REPO,
                env=test_env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            returncode, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            partial = err.stdout or b""
            text = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
            returncode, output = None, f"stopped after {timeout:.0f} s: {text}"
        outcomes: dict[str, str] = {}
        if junit.is_file():
            for case in ET.parse(junit).getroot().iter("testcase"):
                kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
                outcomes[f"{case.get('classname')}::{case.get('name')}"] = kind
        return returncode, output, outcomes

    with ThreadPoolExecutor(max_workers=shards) as pool:
        results = list(pool.map(shard, range(min(shards, len(node_ids)))))
    codes = [code for code, _, _ in results]
    return {
        "returncode": None if None in codes else max(c for c in codes if c is not None),
        "wall_s": time.perf_counter() - started,
        "outcomes": {name: kind for _, _, outcomes in results for name, kind in outcomes.items()},
        "tail": "\n".join(output[-6000:] for _, output, _ in results),
    }


def run_line(name: str, overrides: tuple[str, ...], work: Path, extensions: Path, timeout: float) -> dict[str, Any]:
    import torch

    run_dir = work / name
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(torch.cuda.device_count()),
        "--master_port",
        str(free_port()),
        "-m",
        "ds_exp",
        *overrides,
        f"train.max_steps={STEPS}",
        "train.log_every=5",
        f"hydra.run.dir={run_dir}",
        f"data.cache_dir={work / 'data_cache'}",
    ]
    extra = {"TORCH_EXTENSIONS_DIR": str(extensions), "TORCH_CUDA_ARCH_LIST": os.environ.get("GPU_CHECK_ARCH", "9.0a")}
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=work, env=env(**extra), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"overrides": list(overrides), "returncode": None, "error": f"stopped after {timeout:.0f} s"}
    result: dict[str, Any] = {
        "overrides": list(overrides),
        "returncode": proc.returncode,
        "wall_s": time.perf_counter() - started,
        "compiled": [line for line in proc.stderr.splitlines() if line.startswith("ds_exp: compiling")],
    }
    summary_file = run_dir / "summary.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        keys = ("status", "error", "precision", "optimizer", "backend", "mfu", "tokens_per_s_per_device")
        result.update({k: summary.get(k) for k in (*keys, "skipped_steps", "peak_memory_bytes_per_rank")})
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        result["losses"] = [x["loss"] for x in lines if x["type"] == "train"]
        result["loss_scales"] = [x.get("loss_scale") for x in lines if x["type"] == "train"]
    if proc.returncode:
        result["stderr_tail"] = proc.stderr[-3000:]
    return result


def main(
    quick: bool = False, jobs: int = 1, deadline_s: float | None = None, skip: tuple[str, ...] = ()
) -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device here")
        return None
    from bench import gpu_throughput, long_context

    started = time.perf_counter()
    deadline = started + (deadline_s or 24 * 3600)

    def left() -> float:
        return deadline - time.perf_counter()

    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    payload: dict[str, Any] = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count()}
    payload["settings"] = {"quick": quick, "jobs": jobs, "deadline_s": deadline_s, "skip": list(skip)}
    extensions = work / "torch_extensions"  # empty at the first line: whatever is compiled shows
    lines: dict[str, dict[str, Any]] = {}
    payload["lines"] = lines

    def line(name: str) -> None:
        if left() < 60:
            lines[name] = {"overrides": list(LINES[name]), "error": "not run: past the deadline"}
            return
        print(f"{name}: python -m ds_exp {' '.join(LINES[name])}", flush=True)
        result = lines[name] = run_line(name, LINES[name], work, extensions, timeout=left())
        print(
            f"  {name}: {result.get('status', result.get('error', result.get('returncode')))}, "
            f"{result.get('wall_s', 0):.0f}s, compiled {result.get('compiled')}",
            flush=True,
        )

    # with --jobs N > 1, pytest (in N processes) and the lines (N at a time) side by side; else one after the other
    with ThreadPoolExecutor(max_workers=1) as pool:
        tests = pool.submit(run_pytest, work, left(), jobs) if "tests" not in skip else None
        if tests is not None and jobs == 1:
            tests.result()
        if "lines" not in skip:
            with ThreadPoolExecutor(max_workers=jobs) as line_pool:
                list(line_pool.map(line, LINES))
        if tests is not None:
            payload["gpu_tests"] = tests.result()
            print(f"pytest -m gpu: {payload['gpu_tests']['outcomes']}", flush=True)
    ran = {name: r for name, r in lines.items() if "status" in r}
    payload["checks"] = {
        "only_offload_compiles": all(not r["compiled"] for n, r in ran.items() if not n.startswith("offload")),
        "every_line_completed": all(r.get("status") == "completed" for r in lines.values()) and bool(lines),
        "precision_auto_is_bf16": lines.get("precision_auto", {}).get("precision") == "bf16",
        "fp16_ran": all(lines.get(f"zero{s}_fp16", {}).get("status") == "completed" for s in range(4)),
        # the same training at every stage: fp16's last loss within 3% of bf16's (at ZeRO-0 it was 8% off while
        # DeepSpeed left the loss unscaled there: ds_exp/train/step.py's Fp16LossScale)
        "fp16_learns_like_bf16": all(
            abs(fp16[-1] - bf16[-1]) <= 0.03 * abs(bf16[-1])
            for s in range(4)
            if (fp16 := lines.get(f"zero{s}_fp16", {}).get("losses"))
            and (bf16 := lines.get(f"zero{s}_bf16", {}).get("losses"))
        ),
        "gpu_tests_passed": payload.get("gpu_tests", {}).get("returncode") == 0,
    }
    write_result("gpu_check", payload)
    if "throughput" not in skip:
        payload["throughput"] = gpu_throughput.main(quick=quick, deadline=deadline)
        write_result("gpu_check", payload)
    if "long_context" not in skip and left() > 120:
        (work / "long_context").mkdir()
        payload["long_context"] = long_context.gpu_main(work / "long_context", quick=quick)
    payload["wall_s"] = time.perf_counter() - started
    path = write_result("gpu_check", payload)
    print(json.dumps(payload["checks"], indent=2))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick throughput set")
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes and lines at a time, side by side")
    parser.add_argument("--deadline-s", type=float, help="start nothing new after this many seconds")
    parser.add_argument("--skip", nargs="*", default=(), choices=("tests", "lines", "throughput", "long_context"))
    args = parser.parse_args()
    main(quick=args.quick, jobs=args.jobs, deadline_s=args.deadline_s, skip=tuple(args.skip))
