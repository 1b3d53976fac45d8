"""Each side is a real ds_exp run launched as users do (`python -m ds_exp`, or torch.distributed.run for N ranks);
parity only reads what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_exp.core.status import RunStatus
from ds_exp.launch.rendezvous import free_port
from ds_exp.tools.parity.sides import Side

# launcher variables of a process that itself runs under a launcher: the sides start their own
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


@dataclass
class SideRun:
    run_dir: Path
    log: Path  # the side's console output (stdout and stderr)
    returncode: int
    seconds: float
    summary: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl

    @property
    def train(self) -> dict[int, dict[str, Any]]:
        return {r["step"]: r for r in self.records if r.get("type") == "train"}

    @property
    def final_eval(self) -> dict[str, Any] | None:
        evals = [r for r in self.records if r.get("type") == "eval"]
        return evals[-1] if evals else None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.summary.get("status") == RunStatus.COMPLETED

    @property
    def diverged(self) -> bool:
        """It ran to its end and diverged (ds_exp.model.divergence): its steps are still compared, and fail."""
        return self.summary.get("status") == RunStatus.DIVERGED

    def error(self) -> str:
        """Why the side failed: summary.json's error, else the end of its console output."""
        if self.summary.get("error"):
            return str(self.summary["error"])
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        tail = [line for line in text.splitlines() if line.strip()][-15:]
        return "\n".join(tail) or f"exit status {self.returncode}, no output"


def command(side: Side, forced: list[str]) -> list[str]:
    args = [*side.overrides, *forced]
    if side.ranks == 1:
        return [sys.executable, "-m", "ds_exp", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(side.ranks),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "ds_exp",
        *args,
    ]


def run_side(side: Side, forced: list[str], run_dir: Path, log: Path) -> SideRun:
    """Run the side to its end (in the current directory, so relative paths mean what they mean to the user)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(side.env)
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(command(side, forced), env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    run = SideRun(run_dir, log, proc.returncode, time.perf_counter() - started)
    summary = run_dir / "summary.json"
    if summary.is_file():
        run.summary = json.loads(summary.read_text())
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        run.records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return run
