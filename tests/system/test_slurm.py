"""Sweeps through hydra-submitit-launcher: on a real one-node SLURM cluster (Debian's slurm-wlm + munge,
started by launchers/slurm_cluster.sh) and with submitit's local executor. Each job is a 2-rank run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.training import FAST, REPO, assert_close, launch, logged_steps, multirun, report_rows, user_env

pytestmark = pytest.mark.slow


def _cluster_up() -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mix", "alloc"))


@pytest.fixture(scope="module")
def slurm():
    """A running cluster: the one .ci/run started, or one started here (root + slurm-wlm + munge needed)."""
    if not _cluster_up():
        if shutil.which("slurmctld") is None or os.geteuid() != 0:
            pytest.skip("no SLURM here: apt-get install slurm-wlm munge and run as root (.ci/run does both)")
        started = subprocess.run(
            [str(REPO / "launchers" / "slurm_cluster.sh"), "start"], capture_output=True, text=True, timeout=120
        )
        if started.returncode != 0 or not _cluster_up():
            pytest.skip(f"the SLURM cluster did not start: {started.stderr[-500:]}")
    return True


def sweep(tmp_path, *overrides):
    sweep_dir = tmp_path / "sweep"
    proc = multirun(tmp_path, sweep_dir, *overrides, *FAST, "train.max_steps=4", f"data.cache_dir={tmp_path / 'cache'}")
    return proc, sweep_dir


def newest_job_id() -> int:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True).stdout
    return max((int(i.split("_")[0]) for i in out.split()), default=0)


def losses(job_dir):
    lines = (job_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["type"] == "train"]


def test_zero_sweep_on_slurm_with_two_tasks_per_job(slurm, tmp_path):
    """Two jobs, the stages furthest apart (nothing partitioned; everything): what this proves is SLURM's part,
    each job one 2-task run and the sweep's report of them; the four stages' equal losses on 2 ranks are
    test_training's zero_runs (each job here: two fresh interpreters, ~20 s of CI's 2 cores)."""
    proc, sweep_dir = sweep(
        tmp_path,
        "zero=stage0,stage3",
        "hydra/launcher=slurm",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=15",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = report_rows(sweep_dir)
    assert [(r["zero_stage"], r["status"], r["world_size"]) for r in rows] == [
        (str(stage), "completed", "2") for stage in (0, 3)
    ]
    for job in range(2):
        logs = sorted(p.name for p in (sweep_dir / str(job) / "logs").iterdir())
        assert logs == ["rank0.log", "rank1.log"]
        assert "launch submitit: rank 1 of 2" in (sweep_dir / str(job) / "logs" / "rank1.log").read_text()
        assert_close(losses(sweep_dir / str(job)), losses(sweep_dir / "0"))
    assert (sweep_dir / "report.png").is_file() and (sweep_dir / "report.md").is_file()


def test_invalid_combination_is_refused_before_submission(slurm, tmp_path):
    before = newest_job_id()
    proc, sweep_dir = sweep(tmp_path, "zero=stage2,stage3", "offload=cpu_all", "hydra/launcher=slurm")
    assert proc.returncode == 2
    assert "job [zero=stage2 offload=cpu_all" in proc.stderr
    assert not sweep_dir.exists()
    assert newest_job_id() <= before  # nothing was queued


def test_local_submitit_launcher_with_two_tasks(tmp_path):
    proc, sweep_dir = sweep(tmp_path, "zero=stage2", "hydra/launcher=local", "hydra.launcher.tasks_per_node=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["launcher"] == "submitit"


def test_sbatch_script_runs_one_job_over_several_tasks(slurm, tmp_path):
    """launchers/sbatch_multinode.sh under plain srun (dist.launcher detected as slurm)."""
    proc = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--nodes=1",
            "--ntasks-per-node=2",
            f"--chdir={tmp_path}",
            str(REPO / "launchers" / "sbatch_multinode.sh"),
            *FAST,
            "train.max_steps=2",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=tmp_path,
        env={**user_env(), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    job_id = proc.stdout.split()[-1]
    output = (tmp_path / f"ds_exp-{job_id}.out").read_text() if (tmp_path / f"ds_exp-{job_id}.out").exists() else ""
    assert proc.returncode == 0, proc.stderr + output[-3000:]
    summary = json.loads((tmp_path / "outputs" / "sbatch" / job_id / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["launcher"] == "slurm" and summary["world_size"] == 2


# A job SLURM preempts, or warns of its time limit (`--signal=USR2@<signal_delay_s>`), gets SIGUSR2 on every task.
# The test sends it itself once training is under way (`scancel --signal=USR2`): a time limit lands at a moment
# that depends on the machine's speed and load (at a 2-minute limit a loaded CI machine was warned again and again
# and never finished). About 5 s of training on 2 cores, signalled after step 30 of 300.
REQUEUED_RUN = [
    *FAST,
    "train.max_steps=300",
    "train.log_every=10",
    "data.synthetic.num_train=2048",
]


def test_preempted_job_is_requeued_and_ends_like_an_uninterrupted_run(slurm, tmp_path):
    sweep_dir = tmp_path / "sweep"
    job = sweep_dir / "0"
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    before = newest_job_id()
    sweep_cmd = [sys.executable, "-m", "ds_exp", "-m", *REQUEUED_RUN, cache, f"hydra.sweep.dir={sweep_dir}"]
    slurm_job = ["hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=15"]
    with subprocess.Popen(
        [*sweep_cmd, *slurm_job],
        cwd=tmp_path,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        deadline = time.monotonic() + 600
        while logged_steps(job) < 30 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        job_id = newest_job_id()
        assert job_id > before and logged_steps(job) < 300, "the job ended or never trained before the signal"
        subprocess.run(["scancel", "--signal=USR2", str(job_id)], check=True, timeout=30)
        # the uninterrupted run trains while SLURM requeues the job: ~25 s with idle cores (KillWait, BeginTime)
        with ThreadPoolExecutor(1) as pool:
            uninterrupted = pool.submit(launch, tmp_path / "reference", *REQUEUED_RUN, cache, launcher="ranks", nproc=2)
            _, stderr = proc.communicate(timeout=900)
            reference = uninterrupted.result()
    assert proc.returncode == 0, stderr[-4000:]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["restarts"] == 1 and "/checkpoints/step" in summary["resumed_from"]
    for rank in (0, 1):  # each rank caught the signal, and they saved one checkpoint together
        assert "caught SIGUSR2" in (job / "logs" / f"rank{rank}.log").read_text()

    assert reference.ok, reference.explain()
    assert_close(losses(job), reference.losses, rel=1e-6)
    assert summary["final_eval"]["eval_loss"] == pytest.approx(reference.summary["final_eval"]["eval_loss"], rel=1e-6)
