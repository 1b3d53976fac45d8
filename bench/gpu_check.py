"""One command that checks a CUDA machine with ds_exp installed, and writes bench/results/gpu_check.json.

    python -m bench.gpu_check            # GPU tests, the user's lines, the throughput benchmark (~25 minutes)
    python -m bench.gpu_check --quick    # the same with the quick throughput set (~12 minutes)

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


def run_pytest(work: Path) -> dict[str, Any]:
    junit = work / "gpu_tests.xml"
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", f"--junitxml={junit}", "tests"],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
    )
    outcomes: dict[str, str] = {}
    if junit.is_file():
        for case in ET.parse(junit).getroot().iter("testcase"):
            kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            outcomes[f"{case.get('classname')}::{case.get('name')}"] = kind
    return {
        "returncode": proc.returncode,
        "wall_s": time.perf_counter() - started,
        "outcomes": outcomes,
        "tail": (proc.stdout + proc.stderr)[-6000:],
    }


def run_line(name: str, overrides: tuple[str, ...], work: Path, extensions: Path) -> dict[str, Any]:
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
    proc = subprocess.run(cmd, cwd=work, env=env(**extra), capture_output=True, text=True, timeout=1800)
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


def main(quick: bool = False) -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device here")
        return None
    from bench import gpu_throughput

    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    payload: dict[str, Any] = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count()}
    print("pytest -m gpu ...", flush=True)
    payload["gpu_tests"] = run_pytest(work)
    print(f"  {payload['gpu_tests']['outcomes']}", flush=True)
    payload["lines"] = {}
    extensions = work / "torch_extensions"  # empty at the first line: whatever is compiled shows
    for name, overrides in LINES.items():
        print(f"{name}: python -m ds_exp {' '.join(overrides)}", flush=True)
        result = payload["lines"][name] = run_line(name, overrides, work, extensions)
        print(f"  {result.get('status', result['returncode'])}, {result['wall_s']:.0f}s, compiled {result['compiled']}")
    payload["checks"] = {
        "users_line_first_launch_compiles_nothing": payload["lines"]["zero0_bf16"]["compiled"] == []
        and payload["lines"]["users_line"].get("status") == "completed",
        "precision_auto_is_bf16": payload["lines"]["precision_auto"].get("precision") == "bf16",
        "fp16_ran": all(payload["lines"][f"zero{s}_fp16"].get("status") == "completed" for s in range(4)),
        "gpu_tests_passed": payload["gpu_tests"]["returncode"] == 0,
    }
    payload["throughput"] = gpu_throughput.main(quick=quick)
    from bench import long_context

    (work / "long_context").mkdir()
    payload["long_context"] = long_context.gpu_main(work / "long_context", quick=quick)
    path = write_result("gpu_check", payload)
    print(json.dumps(payload["checks"], indent=2))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick throughput set")
    main(quick=parser.parse_args().quick)
