"""Run ds_exp as users do (python -m, torchrun, the deepspeed launcher, mpirun) and read back what it wrote."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from tests.zygote import run_python, run_ranks

REPO = Path(__file__).resolve().parents[1]

# Short, fully logged runs on a small slice of the embedded task.
FAST = [
    "train.max_steps=8",
    "train.log_every=1",
    "train.eval_at_start=false",
    "train.save_final_checkpoint=false",
    "train.export=false",
    "train.micro_batch_size=4",
    "data.synthetic.num_train=256",
    "data.synthetic.num_eval=32",
]


# Variables users keep set in their shells that change what a test means (issue 31 §10): the hub's offline mode
# (a hub id's message differs), where Hugging Face keeps its files, wandb's mode, Hydra's full tracebacks (every
# "no traceback" check). The tests run as on a machine where none is set, whatever the shell holds; a test that means
# one sets it itself (the catalogue's offline hub id, the trackers' WANDB_MODE=offline).
USER_SHELL_VARIABLES = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "HF_HOME",
    "HF_HUB_CACHE",
    "WANDB_MODE",
    "HYDRA_FULL_ERROR",
)


def without_user_shell(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items() if name not in USER_SHELL_VARIABLES}


def pin_test_environment() -> None:
    """The tests' own process without the user's shell variables (conftest.py, before any test runs)."""
    for name in USER_SHELL_VARIABLES:
        os.environ.pop(name, None)


# pytest-xdist's workers share the machine's cores as the ranks of one launch share a node: each worker's runs (in
# its process, forked from its zygote, its sweeps) get the worker's share of them, unless the shell set it. Two
# workers whose runs each took every core oversubscribed the 2-core machine, and OpenMP's spinning threads then made
# a small model's steps 3-6x slower (a 150-step reward run: 29 s alone; beside the suite 83-189 s at 2 threads,
# 29-65 s at 1). The launcher scripts' own runs do not get it: how they set the ranks' threads is under test there.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
WORKER_SHARE = (
    {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))}
    if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ
    else {}
)
os.environ.update(WORKER_SHARE)

# The environment the tests started with: libraries imported in-process later write to os.environ (mlflow its
# telemetry session, tensorboardX CRC32C_SW_MODE), which a user's shell would not hold (and which would give every
# later run a zygote of its own: tests/zygote.py). conftest.py imports this module first.
SHELL_ENVIRON = without_user_shell(os.environ)


def user_env() -> dict[str, str]:
    """A user's shell: this checkout importable, wandb quiet, and no launcher variables from elsewhere."""
    env = {**SHELL_ENVIRON, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    run_dir: Path

    @property
    def ok(self) -> bool:
        return self.proc.returncode == 0

    def records(self, kind: str) -> list[dict[str, Any]]:
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["type"] == kind]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records("train")]

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())

    def explain(self) -> str:
        return (
            f"rc={self.proc.returncode}\n--- stdout\n{self.proc.stdout[-4000:]}\n--- stderr\n{self.proc.stderr[-6000:]}"
        )


def launch(
    run_dir: Path,
    *overrides: str,
    launcher: str = "single",
    nproc: int = 1,
    cache_dir: Path | None = None,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> Run:
    """Start one run the way a user would and wait for it. `launcher`: single (`python -m ds_exp`), torchrun,
    deepspeed or mpirun (the scripts in launchers/), or ranks: `nproc` ranks with torchrun's environment, forked
    from the test zygote, where the launcher is not what a test is about (tests/zygote.py)."""
    args = [*overrides, f"hydra.run.dir={run_dir}"]
    if cache_dir is not None:
        args.append(f"data.cache_dir={cache_dir}")
    full_env = {**user_env(), **(env or {}), "MASTER_PORT": str(free_port())}
    full_env["PYTHON"] = sys.executable
    where = cwd or run_dir.parent
    forked: subprocess.CompletedProcess | None = None
    if launcher == "single":  # `python -m ds_exp`, forked from a zygote where that is the same (tests/zygote.py)
        forked = run_python(["-m", "ds_exp", *args], cwd=where, env=full_env, timeout=timeout)
    elif launcher == "ranks":  # N ranks as torchrun starts them, forked from a zygote, or else torchrun itself
        forked = run_ranks(nproc, ["-m", "ds_exp", *args], cwd=where, env=full_env, timeout=timeout)
        launcher = "torchrun"
    elif launcher not in ("torchrun", "deepspeed", "mpirun"):
        raise ValueError(launcher)
    if forked is not None:
        return Run(forked, run_dir)
    cmd = [str(REPO / "launchers" / f"{launcher}.sh"), str(nproc), *args]  # the scripts users run
    for name in WORKER_SHARE:
        if name not in (env or {}):
            full_env.pop(name)
    proc = subprocess.run(cmd, cwd=where, env=full_env, capture_output=True, text=True, timeout=timeout)
    return Run(proc, run_dir)


def train_here(run_dir: Path, *overrides: str, cache_dir: Path | None = None, env: dict[str, str] | None = None) -> Run:
    """One rank of the recipe in this process, through ds_exp's Python API (ds_exp/train/api.py), for tests of what
    the recipe does where no process boundary is under test: the run directory and files of `launch`, without a
    child process (its start, its process group's, and the first-use costs every new process pays again). Its
    stdout and stderr are captured; a DsExpError is the exit status and message the command line would give. `env`:
    variables the run reads when it runs (WANDB_MODE, DS_EXP_*), set for the run only; what libraries read when
    they are imported needs a process of its own (`launch`)."""
    import torch

    from ds_exp import train
    from ds_exp.core.errors import DsExpError

    if WORKER_SHARE:  # read when torch loads, which may have been before this module set it
        torch.set_num_threads(int(WORKER_SHARE["OMP_NUM_THREADS"]))

    args = [*overrides, f"hydra.run.dir={run_dir}", *([f"data.cache_dir={cache_dir}"] if cache_dir else [])]
    out, err = io.StringIO(), io.StringIO()
    environment = mock.patch.dict(os.environ, env) if env else contextlib.nullcontext()
    with environment, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            train(args)
            code = 0
        except DsExpError as error:
            print(f"ds_exp: error: {error}", file=sys.stderr)
            code = error.exit_code
    return Run(subprocess.CompletedProcess(["ds_exp.train", *args], code, out.getvalue(), err.getvalue()), run_dir)


def multirun(
    cwd: Path, sweep_dir: Path, *overrides: str, env: dict[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    """`python -m ds_exp -m OVERRIDES` with its sweep directory at `sweep_dir`."""
    return run_python(
        ["-m", "ds_exp", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
        cwd=cwd,
        env={**user_env(), **(env or {})},
        timeout=timeout,
    )


def report_rows(sweep_dir: Path) -> list[dict[str, str]]:
    with (sweep_dir / "report.csv").open() as fh:
        return list(csv.DictReader(fh))


def assert_close(a: list[float], b: list[float], rel: float = 1e-4) -> None:
    assert len(a) == len(b) and a, (a, b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= rel * max(abs(x), abs(y)), f"step {i + 1}: {x} vs {y} (all: {a} vs {b})"


def logged_steps(run_dir: Path) -> int:
    """The last step with a train metric line so far (0 before the first): for tests that act mid-run."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if r["type"] == "train"]
    return max(steps, default=0)
