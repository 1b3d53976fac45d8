"""One command that checks a CUDA machine with ds_exp installed, in under 12 minutes.
It writes bench/results/gpu_check.json (and gpu_throughput.json).

    bench/gpu_setup.sh install .whl && python -m bench.gpu_check    # a bare H100: setup ~30 s, the check <= 640 s
    python -m bench.gpu_check --deadline-s 3600 --jobs 1           # everything, one thing at a time (~25 minutes)
    python -m bench.gpu_check --skip tests lines --only ds_exp_no_liger bare   # a second lease: what did not fit

1. `pytest -m gpu` (tests/system/test_gpu.py, and the fp16 fault test), dealt to --jobs pytest processes, beside
2. the user's lines, --jobs at a time, each a short run on every GPU (torchrun, one rank per GPU), the first launch
   with an empty torch extension cache and Hopper's TORCH_CUDA_ARCH_LIST=9.0a: ZeRO 0-3 in bf16 and in fp16 (fp16 at
   ZeRO-0 must learn like bf16: ds_exp.train.step.Fp16LossScale), LoRA, optimizer offload (compiles DeepSpeed's CPU
   Adam, and says so), parameter offload; all with ds_exp's defaults, so the fast path (Liger's kernels, the fused
   loss, torch's varlen attention, compiled layers) runs at every stage. Each records status, wall time, whether an
   op was compiled, losses, skipped steps, both MFUs. Side by side, their wall times and MFUs are not timings.
   Both stop starting work at --phase1-s (230 s by default).
3. bench/gpu_throughput.py, alone: every variant a separate launch, in its order (ds_exp's default line, the Trainer
   with its recommended settings, lora_8b_zero3, the plain path, each fast-path piece off, the bare loop) until the
   deadline; a variant that would end past it is recorded as not run (--only runs those later).
4. Long context (bench/long_context.py's gpu_main), if time is left: the longest sequence that trains one step.
--deadline-s (640 s by default) is when the check ends at the latest: nothing starts that would end past it. The
results file is rewritten after each part, so a run stopped from outside keeps what it finished.
A bare GPU machine needs ds_exp's dependencies first: bench/gpu_setup.sh (no network needed there).
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
# the GPU tests run the user's line (zero=stage3 precision=bf16 lora.dim=64) and precision=auto themselves
LINES: dict[str, tuple[str, ...]] = {
    **{f"zero{s}_bf16": (f"zero=stage{s}", "precision=bf16") for s in range(4)},
    **{f"zero{s}_fp16": (f"zero=stage{s}", "precision=fp16") for s in range(4)},
    "lora_zero2": ("zero=stage2", "precision=bf16", "lora.dim=64"),
    "offload_optimizer": ("zero=stage2", "precision=bf16", "offload=cpu"),
    "offload_all": ("zero=stage3", "precision=bf16", "offload=cpu_all"),
}
DEADLINE_S, PHASE1_S, JOBS = 640.0, 230.0, 4
# inductor compiles with one worker per core by default: eight processes side by side would start 16 each
COMPILE_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "4"}


# The files holding `gpu` tests (tests/unit/test_structure.py keeps this list whole): collecting only these keeps the
# dev-only packages the other test files import (gguf, optuna, mlflow, tensorboard) off a bare GPU machine.
GPU_TEST_FILES = ("tests/system/test_gpu.py", "tests/integration/test_faults.py")


def run_pytest(work: Path, timeout: float, shards: int = 1) -> dict[str, Any]:
    """`pytest -m gpu`, its tests dealt round-robin to `shards` pytest processes run side by side."""
    started = time.perf_counter()
    base = [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-p", "no:cacheprovider"]  # the shards: no xdist
    # no test zygote: a process forked after CUDA's driver was initialized (DeepSpeed asks at import) cannot use it
    test_env = env(DS_EXP_NO_ZYGOTE="1", **COMPILE_ENV)
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
    extra = {
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "TORCH_CUDA_ARCH_LIST": os.environ.get("GPU_CHECK_ARCH", "9.0a"),
        **COMPILE_ENV,
    }
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
        keys = ("status", "error", "precision", "optimizer", "backend", "mfu", "mfu_with_attention", "fast_path")
        more = ("tokens_per_s_per_device", "compile_s", "skipped_steps", "peak_memory_bytes_per_rank")
        result.update({k: summary.get(k) for k in (*keys, *more)})
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        result["losses"] = [x["loss"] for x in lines if x["type"] == "train"]
        result["loss_scales"] = [x.get("loss_scale") for x in lines if x["type"] == "train"]
    if proc.returncode:
        result["stderr_tail"] = proc.stderr[-3000:]
    return result


def main(
    jobs: int = JOBS,
    deadline_s: float = DEADLINE_S,
    phase1_s: float = PHASE1_S,
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] = (),
) -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device here")
        return None
    from bench import gpu_throughput, long_context

    started = time.perf_counter()
    deadline = started + deadline_s
    phase1 = started + min(phase1_s, deadline_s)

    def left(until: float = deadline) -> float:
        return until - time.perf_counter()

    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    payload: dict[str, Any] = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count()}
    payload["settings"] = {"jobs": jobs, "deadline_s": deadline_s, "phase1_s": phase1_s, "skip": list(skip)}
    extensions = work / "torch_extensions"  # empty at the first line: whatever is compiled shows
    lines: dict[str, dict[str, Any]] = {}
    payload["lines"] = lines

    def line(name: str) -> None:
        if left(phase1) < 45:
            lines[name] = {"overrides": list(LINES[name]), "error": "not run: past the first phase's end"}
            return
        print(f"{name}: python -m ds_exp {' '.join(LINES[name])}", flush=True)
        result = lines[name] = run_line(name, LINES[name], work, extensions, timeout=max(left(phase1) + 60, 60))
        print(
            f"  {name}: {result.get('status', result.get('error', result.get('returncode')))}, "
            f"{result.get('wall_s', 0):.0f}s, compiled {result.get('compiled')}",
            flush=True,
        )

    # pytest (in `jobs` processes) and the lines (`jobs` at a time) side by side until the first phase ends
    with ThreadPoolExecutor(max_workers=1) as pool:
        tests = pool.submit(run_pytest, work, max(left(phase1), 60), jobs) if "tests" not in skip else None
        if "lines" not in skip:
            with ThreadPoolExecutor(max_workers=jobs) as line_pool:
                list(line_pool.map(line, LINES))
        if tests is not None:
            payload["gpu_tests"] = tests.result()
            print(f"pytest -m gpu: {payload['gpu_tests']['outcomes']}", flush=True)
    payload["checks"] = checks(lines, payload)
    payload["phase1_wall_s"] = time.perf_counter() - started
    write_result("gpu_check", payload)
    if "throughput" not in skip:
        names = only or tuple(gpu_throughput.VARIANTS)
        payload["throughput"] = gpu_throughput.main(deadline=deadline, names=names)
        write_result("gpu_check", payload)
    if "long_context" not in skip and left() > 150:
        (work / "long_context").mkdir()
        payload["long_context"] = long_context.gpu_main(work / "long_context", quick=True, deadline=deadline)
    payload["wall_s"] = time.perf_counter() - started
    path = write_result("gpu_check", payload)
    print(json.dumps(payload["checks"], indent=2))
    print(f"wrote {path} ({payload['wall_s']:.0f} s)")
    return payload


def checks(lines: dict[str, dict[str, Any]], payload: dict[str, Any]) -> dict[str, bool]:
    ran = {name: r for name, r in lines.items() if "status" in r}
    fast = [r.get("fast_path") or {} for r in ran.values()]
    return {
        "only_offload_compiles": all(not r["compiled"] for n, r in ran.items() if not n.startswith("offload")),
        "every_line_completed": all(r.get("status") == "completed" for r in lines.values()) and bool(lines),
        "fp16_ran": all(lines.get(f"zero{s}_fp16", {}).get("status") == "completed" for s in range(4)),
        # the same training at every stage: fp16's last loss within 3% of bf16's (at ZeRO-0 it was 8% off while
        # DeepSpeed left the loss unscaled there: ds_exp/train/step.py's Fp16LossScale)
        "fp16_learns_like_bf16": all(
            abs(fp16[-1] - bf16[-1]) <= 0.03 * abs(bf16[-1])
            for s in range(4)
            if (fp16 := lines.get(f"zero{s}_fp16", {}).get("losses"))
            and (bf16 := lines.get(f"zero{s}_bf16", {}).get("losses"))
        ),
        # the default line is the fast path: Liger's kernels and the fused loss at every stage
        "fast_path_on_by_default": bool(fast) and all(f.get("liger_kernel") and f.get("fused_loss") for f in fast),
        "gpu_tests_passed": payload.get("gpu_tests", {}).get("returncode") == 0,
    }


if __name__ == "__main__":
    from bench.gpu_throughput import VARIANTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=JOBS, help="pytest processes and lines at a time, side by side")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="end by then, at the latest")
    parser.add_argument("--phase1-s", type=float, default=PHASE1_S, help="when the tests and the lines stop starting")
    parser.add_argument("--skip", nargs="*", default=(), choices=("tests", "lines", "throughput", "long_context"))
    parser.add_argument("--only", nargs="*", default=(), choices=tuple(VARIANTS), help="these throughput variants")
    args = parser.parse_args()
    main(args.jobs, args.deadline_s, args.phase1_s, tuple(args.skip), tuple(args.only))
