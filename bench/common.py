"""Shared by the benchmarks: timing statistics, running commands as users do, result files, tables."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def stats(samples: Sequence[float]) -> dict[str, float]:
    """Median and spread (interquartile range, min, max) of repeated measurements."""
    ordered = sorted(samples)
    if not ordered:
        return {"n": 0}
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "q1": q[0],
        "q3": q[2],
        "min": ordered[0],
        "max": ordered[-1],
    }


def env(**extra: str) -> dict[str, str]:
    """A user's shell: this checkout importable, wandb off, no launcher variables from elsewhere."""
    out = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", **extra}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(name, None)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command line of `torchrun --nproc_per_node N ARGS` with a free rendezvous port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        *args,
    ]


def run(cmd: Sequence[str], *, cwd: Path | None = None, timeout: float = 900, **extra_env: str) -> tuple[float, str]:
    """Run a command to completion; returns its wall time and combined output. Raises on failure."""
    started = time.perf_counter()
    proc = subprocess.run(list(cmd), cwd=cwd, env=env(**extra_env), capture_output=True, text=True, timeout=timeout)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return elapsed, proc.stdout + proc.stderr


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    for name in ("deepspeed", "transformers", "datasets"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """bench/results/<name>.json, with the machine it was measured on."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **payload}, indent=2, default=str) + "\n")
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (also readable as printed text)."""

    def cell(value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def compose(*overrides: str) -> Any:
    """ds_exp's config as `python -m ds_exp OVERRIDES` composes it (Hydra's compose API, as tests/conftest.py)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ds_exp.config.paths import conf_dir
    from ds_exp.config.resolvers import register_resolvers
    from ds_exp.config.schema import register_configs, to_config

    register_resolvers()
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return to_config(hydra_compose(config_name="config", overrides=list(overrides)))


def rss_kib() -> int:
    """This process's resident set now (KiB), from /proc/self/status."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0
