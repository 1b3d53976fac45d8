"""SIGTERM / SIGINT to a running single-process run: a checkpoint after the current step, a clean exit with
128 + the signal, and `resume=auto` ends exactly where an uninterrupted run ends. (SLURM's time-limit signal
and the requeue it leads to are tested on the real cluster in test_slurm.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.training import FAST, Run, assert_close, free_port, launch, logged_steps, train_here, user_env

pytestmark = pytest.mark.slow

# Metric lines every 10 steps, so a stop usually falls inside a metric window (carried over by the checkpoint).
# 64 steps an epoch (256 rows, 4 a step): stopped after step 30, the resumed run crosses into the second epoch.
STOPPABLE = [*FAST, "train.max_steps=100", "train.log_every=10"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache_dir) -> Run:
    run = train_here(tmp_path_factory.mktemp("uninterrupted") / "run", *STOPPABLE, cache_dir=cache_dir)
    assert run.ok, run.explain()
    return run


def start_and_signal(run_dir: Path, cache_dir: Path, signum: int, after_step: int) -> tuple[int, str]:
    """Start a run, send `signum` once it has logged `after_step`; return its exit code and stderr."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    stderr_file = run_dir.parent / "stderr.txt"
    with stderr_file.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ds_exp", *STOPPABLE, f"hydra.run.dir={run_dir}", f"data.cache_dir={cache_dir}"],
            cwd=run_dir.parent,
            env={**user_env(), "MASTER_PORT": str(free_port())},
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        deadline = time.monotonic() + 300
        while logged_steps(run_dir) < after_step:
            assert proc.poll() is None, f"the run ended before step {after_step}: {stderr_file.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no progress within 300 s"
            time.sleep(0.05)
        proc.send_signal(signum)
        code = proc.wait(timeout=120)
    return code, stderr_file.read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_a_checkpoint_and_resume_ends_like_an_uninterrupted_run(
    signum, tmp_path, cache_dir, uninterrupted
):
    run_dir = tmp_path / "run"
    code, stderr = start_and_signal(run_dir, cache_dir, signum, after_step=30)
    assert code == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert summary["status"] == "stopped" and 30 <= stopped_at < 64
    assert summary["error"].startswith(f"stopped by {signal.Signals(signum).name} after step {stopped_at}")
    # the exact command to paste, as the README's resume section shows it (issue 35 §7)
    assert f"; continue it with: python -m ds_exp hydra.run.dir={run_dir} resume=auto\n" in stderr, stderr[-2000:]
    assert (run_dir / "checkpoints" / f"step{stopped_at}" / "ds_exp_complete.json").is_file()
    assert not (run_dir / "hf_model").exists()  # nothing that looks like a finished run

    resumed = launch(run_dir, *STOPPABLE, "resume=auto", cache_dir=cache_dir)
    assert resumed.ok, resumed.explain()
    assert resumed.summary["status"] == "completed"
    assert resumed.summary["resumed_from"].endswith(f"step{stopped_at}")
    # metrics.jsonl holds both parts: the same lines, every 10 steps, as the uninterrupted run
    assert [r["step"] for r in resumed.records("train")] == [r["step"] for r in uninterrupted.records("train")]
    assert_close(resumed.losses, uninterrupted.losses, rel=1e-6)
    assert resumed.summary["final_eval"]["eval_loss"] == pytest.approx(
        uninterrupted.summary["final_eval"]["eval_loss"], rel=1e-6
    )


def test_a_closed_terminal_stops_the_run_with_a_checkpoint_as_sigterm_does(tmp_path, cache_dir):
    """The run's terminal hangs up (a pty whose other end is closed, as when an ssh session drops): the kernel
    sends SIGHUP, and writing to the terminal fails from then on. The run saves, records why, and exits."""
    import fcntl
    import os
    import pty
    import select
    import termios
    import threading

    run_dir = tmp_path / "run"
    master, terminal = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ds_exp",
            *FAST,
            "train.max_steps=400",
            f"hydra.run.dir={run_dir}",
            f"data.cache_dir={cache_dir}",
        ],
        cwd=tmp_path,
        env={**user_env(), "MASTER_PORT": str(free_port())},
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,  # its own session, whose controlling terminal is the pty
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )
    os.close(terminal)
    reading = True

    def drain() -> None:  # what a terminal does: reads the output, so the run never blocks on it
        while reading:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    os.read(master, 65536)
                except OSError:
                    return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while logged_steps(run_dir) < 3:
        assert proc.poll() is None, "the run ended before step 3"
        assert time.monotonic() < deadline, "no progress within 300 s"
        time.sleep(0.05)
    reading = False
    reader.join()
    os.close(master)  # the terminal is gone
    code = proc.wait(timeout=120)
    assert code == 128 + signal.SIGHUP
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert summary["status"] == "stopped" and 3 <= stopped_at < 400
    assert summary["error"].startswith(f"stopped by SIGHUP after step {stopped_at}; checkpoint")
    assert f"hydra.run.dir={run_dir} resume=auto" in summary["error"]
    assert (run_dir / "checkpoints" / f"step{stopped_at}" / "ds_exp_complete.json").is_file()
    assert "Traceback" not in (run_dir / "ds_exp.log").read_text()
