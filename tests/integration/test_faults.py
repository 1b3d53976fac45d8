"""Faults injected for real: a rank killed with SIGKILL in a 2-rank run, a process killed in the middle of
writing a checkpoint, and non-finite losses. Each time nothing is lost: `resume=auto` continues from the last
complete checkpoint and ends with the uninterrupted run's weights. (SIGTERM / SIGINT: test_stop_signals.py;
SLURM's time limit: test_slurm.py; disks and directories: test_disk_faults.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.training import FAST, REPO, Run, assert_close, free_port, launch, logged_steps, train_here, user_env

pytestmark = pytest.mark.slow

# Checkpoints every 20 steps, metric lines every 10, an export to compare final weights.
RESUMABLE = [
    *FAST,
    "train.max_steps=100",
    "train.log_every=10",
    "train.save_every=20",
    "train.keep_last=3",
    "train.export=true",
    "data.synthetic.num_train=1024",
]


def exported_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted((run_dir / "hf_model").glob("*.safetensors"))
    assert files, f"no safetensors export in {run_dir / 'hf_model'}"
    weights: dict = {}
    for file in files:
        weights.update(load_file(file))
    return weights


def assert_same_weights(a: Path, b: Path) -> None:
    import torch

    wa, wb = exported_weights(a), exported_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-6, atol=1e-7, msg=f"{name} differs")


def pids_with(tag: str, rank: int) -> list[int]:
    """Processes started with DS_EXP_TEST_TAG=tag that are rank `rank` of their launch."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DS_EXP_TEST_TAG={tag}".encode() in environ and f"RANK={rank}".encode() in environ:
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def uninterrupted_2ranks(tmp_path_factory, cache_dir) -> Run:
    run = launch(
        tmp_path_factory.mktemp("uninterrupted2") / "run", *RESUMABLE, launcher="ranks", nproc=2, cache_dir=cache_dir
    )
    assert run.ok, run.explain()
    return run


@pytest.fixture(scope="module")
def uninterrupted_1rank(tmp_path_factory, cache_dir) -> Run:
    run = train_here(tmp_path_factory.mktemp("uninterrupted1") / "run", *RESUMABLE, cache_dir=cache_dir)
    assert run.ok, run.explain()
    return run


def test_sigkill_of_one_rank_fails_fast_and_resume_ends_like_an_uninterrupted_run(
    tmp_path, cache_dir, uninterrupted_2ranks
):
    run_dir = tmp_path / "run"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    env = {**user_env(), "MASTER_PORT": str(free_port()), "PYTHON": sys.executable, "DS_EXP_TEST_TAG": tag}
    cmd = [str(REPO / "launchers" / "torchrun.sh"), "2", *RESUMABLE, f"hydra.run.dir={run_dir}"]
    cmd.append(f"data.cache_dir={cache_dir}")
    log_file = tmp_path / "launch.log"
    with log_file.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while logged_steps(run_dir) < 50:  # checkpoints at steps 20 and 40 are complete by then
            assert proc.poll() is None, log_file.read_text()[-4000:]
            assert time.monotonic() < deadline, "no progress within 300 s"
            time.sleep(0.05)
        victims = pids_with(tag, rank=1)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=120)
        took = time.monotonic() - killed
    output = log_file.read_text()
    assert code != 0, output[-3000:]
    assert took < 60, f"the launch took {took:.0f} s to end after rank 1 died"
    assert not pids_with(tag, rank=0), "rank 0 outlived the launch"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert "lost contact with rank 1 (" in summary["error"], summary["error"]  # the other rank, named
    assert "resume=auto" in summary["error"]
    assert not (run_dir / "hf_model").exists()  # nothing that looks like a finished run

    resumed = launch(run_dir, *RESUMABLE, "resume=auto", launcher="ranks", nproc=2, cache_dir=cache_dir)
    assert resumed.ok, resumed.explain()
    assert resumed.summary["status"] == "completed"
    assert resumed.summary["resumed_from"].endswith("step40")
    assert_close(resumed.losses[-5:], uninterrupted_2ranks.losses[-5:], rel=1e-6)
    assert_same_weights(run_dir, uninterrupted_2ranks.run_dir)


def test_kill_while_saving_leaves_the_previous_checkpoint_in_charge(tmp_path, cache_dir, uninterrupted_1rank):
    run_dir = tmp_path / "run"
    # SIGKILL once DeepSpeed has written step40's files, before the checkpoint is marked complete
    crashed = launch(run_dir, *RESUMABLE, cache_dir=cache_dir, env={"DS_EXP_FAULT": "save:step40"})
    assert crashed.proc.returncode == -signal.SIGKILL, crashed.explain()
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "step40").is_dir() and any((checkpoints / "step40").iterdir())
    assert not (checkpoints / "step40" / "ds_exp_complete.json").exists()
    assert (checkpoints / "latest").read_text().strip() == "step20"  # DeepSpeed's pointer names the complete one
    assert not (run_dir / "hf_model").exists()

    resumed = launch(run_dir, *RESUMABLE, "resume=auto", cache_dir=cache_dir)
    assert resumed.ok, resumed.explain()
    assert resumed.summary["resumed_from"].endswith("step20")
    assert (checkpoints / "latest").read_text().strip() == "step100"
    assert_close(resumed.losses[-5:], uninterrupted_1rank.losses[-5:], rel=1e-6)
    assert_same_weights(run_dir, uninterrupted_1rank.run_dir)


def test_a_run_that_keeps_producing_nan_stops_with_the_step_named(tmp_path, cache_dir):
    # a learning rate this large overflows fp32 within a few steps: every later loss is NaN
    run = train_here(
        tmp_path / "run",
        *FAST,
        "train.max_steps=60",
        "optimizer.lr=1e8",
        "train.gradient_clipping=0",
        "train.max_bad_steps=3",
        cache_dir=cache_dir,
    )
    assert run.proc.returncode == 3, run.explain()
    assert "Traceback" not in run.proc.stderr
    summary = run.summary
    assert summary["status"] == "diverged"
    assert "4 optimizer steps in a row ended with a non-finite loss" in summary["error"]
    assert "train.max_bad_steps=3" in summary["error"]
    log_text = (run.run_dir / "logs" / "rank0.log").read_text()
    assert "non-finite loss (1 steps in a row)" in log_text


def strict_json(text: str):
    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_a_run_whose_weights_stop_being_finite_saves_and_exports_nothing_of_them(tmp_path, cache_dir):
    """ZeRO stage 0 in fp32: a learning rate of 1e30 makes the weights NaN after step 2, well within
    train.max_bad_steps. The save at step 2 is refused; step 1's checkpoint stays the newest, nothing is exported,
    the run ends `diverged` with exit status 3, and every JSON file it wrote is strict JSON."""
    run = train_here(
        tmp_path / "run",
        *FAST,
        "optimizer.lr=1e30",
        "train.max_steps=6",
        "train.save_every=1",
        "train.keep_last=0",
        "train.export=true",
        "train.save_final_checkpoint=true",
        cache_dir=cache_dir,
    )
    assert run.proc.returncode == 3, run.explain()
    assert "Traceback" not in run.proc.stderr
    checkpoints = run.run_dir / "checkpoints"
    summary = strict_json((run.run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["steps"] == 2 and summary["export_dir"] is None, summary
    assert "NaN or inf in the weights at step 2: the run diverged and did not save checkpoint step2" in summary["error"]
    assert f"the newest checkpoint with finite weights is {checkpoints / 'step1'}" in summary["error"]
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step1"]
    assert (checkpoints / "latest").read_text().strip() == "step1"
    assert not [p for p in run.run_dir.iterdir() if "hf_model" in p.name]  # no export, no half-made one
    lines = [strict_json(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2] and lines[1]["non_finite"] == ["grad_norm"], lines
    for path in run.run_dir.rglob("*.json"):
        strict_json(path.read_text())


@pytest.mark.gpu
def test_fp16_overflow_skips_steps_without_failing(tmp_path, cache_dir):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("fp16 needs CUDA (DeepSpeed's CPU accelerator refuses fp16)")
    run = train_here(tmp_path / "run", *FAST, "precision=fp16", "precision.initial_scale_power=32", cache_dir=cache_dir)
    assert run.ok, run.explain()
    assert run.records("train")[-1]["skipped_steps"] > 0
    assert "skipped" in (run.run_dir / "logs" / "rank0.log").read_text()


# ------------------------------------------------------------------------------------------ disks and directories


# mount_tmpfs: tests/conftest.py


def test_unwritable_run_directory_is_refused_before_anything_starts(mount_tmpfs):
    read_only = mount_tmpfs("1m", read_only=True)
    run = train_here(read_only / "run", *FAST)
    assert run.proc.returncode == 2, run.explain()
    assert "Traceback" not in run.proc.stderr
    assert f"hydra.run.dir={read_only / 'run'}: {read_only} is on a read-only file system" in run.proc.stderr
    assert "point hydra.run.dir at a writable directory" in run.proc.stderr


def test_a_disk_too_small_for_a_checkpoint_is_refused_before_training(cache_dir, mount_tmpfs):
    small = mount_tmpfs("4m")  # one checkpoint of the tiny model (fp32 weights + Adam) is about 8 MB
    run = train_here(small / "run", *RESUMABLE, cache_dir=cache_dir)
    assert run.proc.returncode == 1, run.explain()
    assert "Traceback" not in run.proc.stderr
    assert "not enough disk space for train.checkpoint_dir=" in run.proc.stderr
    assert not (small / "run").exists()  # refused before any work: nothing left that looks like a run (issue 35 §8)


def test_a_disk_that_fills_up_during_training_leaves_no_corrupt_checkpoint(
    tmp_path, cache_dir, mount_tmpfs, uninterrupted_1rank
):
    disk = mount_tmpfs("40m")
    run_dir = disk / "run"
    filler = disk / "filler"
    cmd = [sys.executable, "-m", "ds_exp", *RESUMABLE, f"hydra.run.dir={run_dir}", f"data.cache_dir={cache_dir}"]
    env = {**user_env(), "MASTER_PORT": str(free_port())}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while logged_steps(run_dir) < 25:  # step20's checkpoint is complete
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no progress within 300 s"
        time.sleep(0.05)
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    filler.write_bytes(b"\0" * (free - 1024 * 1024))  # leave 1 MiB: metric lines fit, a checkpoint does not
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert f"could not write checkpoint {run_dir / 'checkpoints' / 'step40'}" in summary["error"]
    assert "resume=auto" in summary["error"]
    checkpoints = run_dir / "checkpoints"
    assert not (checkpoints / "step40" / "ds_exp_complete.json").exists()
    assert (checkpoints / "latest").read_text().strip() == "step20"

    filler.unlink()
    resumed = launch(run_dir, *RESUMABLE, "train.keep_last=1", "resume=auto", cache_dir=cache_dir, cwd=tmp_path)
    assert resumed.ok, resumed.explain()
    assert resumed.summary["resumed_from"].endswith("step20")
    assert_same_weights(run_dir, uninterrupted_1rank.run_dir)


def test_full_disks_under_the_trackers_then_the_run_are_one_message_each(tmp_path, cache_dir, mount_tmpfs):
    """The trackers' stores (MLflow's SQLite, TensorBoard's event files, wandb's offline files) on one small disk,
    the run directory on another, checkpoints on a third. The stores' disk fills at step 2: each tracker says so once
    and the run goes on (no hang: tensorboardX's writer thread would block it forever). Then the run directory's
    disk fills: metrics.jsonl stops the run with one message; no traceback, no .tmp, no line or record cut
    short, and the checkpoints as they were."""
    run_disk, stores = mount_tmpfs("2m"), mount_tmpfs("4m")
    run_dir, checkpoints = run_disk / "run", tmp_path / "checkpoints"
    overrides = [
        *FAST,
        "train.max_steps=200",  # never reached: the full disk stops the run within a few lines
        "train.save_every=3",
        "train.allow_outside_run_dir=true",
        f"train.checkpoint_dir={checkpoints}",
        "logger=[wandb,tensorboard,mlflow]",
        "logger.wandb.mode=offline",
        f"logger.wandb.dir={stores}",
        f"logger.tensorboard.dir={stores / 'tb'}",
        f"logger.mlflow.tracking_uri=sqlite:///{stores / 'mlflow.db'}",
    ]
    cmd = [sys.executable, "-m", "ds_exp", *overrides, f"hydra.run.dir={run_dir}", f"data.cache_dir={cache_dir}"]
    env = {**user_env(), "MASTER_PORT": str(free_port())}
    out, err = (tmp_path / "stdout").open("w"), (tmp_path / "stderr").open("w")  # pipes could fill and block it
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=err)

    def fill(disk: Path) -> None:  # to the last byte, again and again: what the run frees is taken back
        with contextlib.suppress(OSError), (disk / "filler").open("ab") as filler:
            while True:
                filler.write(b"\0" * 4096)
                filler.flush()

    stores_of = {"MLflow": f"sqlite:///{stores}/mlflow.db", "TensorBoard": stores / "tb", "wandb": stores}

    def trackers_told() -> bool:  # a store fails only when its next write needs a new page: wait for all three
        output = (tmp_path / "stdout").read_text() + (tmp_path / "stderr").read_text()
        return all(f"{tracker}: could not write to {where}" in output for tracker, where in stores_of.items())

    phases = (
        (lambda: logged_steps(run_dir) >= 2, []),
        (trackers_told, [stores]),
        (lambda: False, [stores, run_disk]),  # until it ends
    )
    deadline = time.monotonic() + 300
    try:
        for done, full in phases:
            while not done() and proc.poll() is None:
                assert time.monotonic() < deadline, "the run hangs"
                for disk in full:
                    fill(disk)
                time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        out.close(), err.close()
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    output = stdout + stderr
    assert proc.returncode == 1, output[-4000:]
    assert "Traceback" not in output and "Logging error" not in output, output[-4000:]
    for tracker, where in stores_of.items():
        said = [line for line in output.splitlines() if f"{tracker}: could not write to {where}" in line]
        assert len(said) == 1 and "the run goes on" in said[0], output[-4000:]
    (message,) = [line for line in stderr.splitlines() if line.startswith("ds_exp: error:")]
    assert f"could not write {run_dir / 'metrics.jsonl'} (No space left on device" in message
    assert "resume=auto" in message
    summary = run_dir / "summary.json"
    assert summary.is_file() or f"{summary} was not written (No space left on device)" in message
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, len(lines) + 1))  # none cut short
    from tests.integration.test_trackers import scalars

    assert [s for s, _ in scalars(stores / "tb", "train/loss")][:2] == [1, 2]  # readable: no record cut short
    assert not [p for root in (run_disk, stores, checkpoints) for p in root.rglob("*.tmp*")]
    newest = (checkpoints / "latest").read_text().strip()
    assert (checkpoints / newest / "ds_exp_complete.json").is_file() and int(newest.removeprefix("step")) >= 3


# ------------------------------------------------------------------------------------------------- shared data


def test_four_sweep_jobs_starting_at_once_build_the_data_cache_once(tmp_path):
    cache = tmp_path / "cache"
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_exp",
            "-m",
            "zero=stage0,stage1,stage2,stage3",
            "hydra/launcher=local",
            *FAST,
            "train.max_steps=2",
            f"data.cache_dir={cache}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/summary.json"))]
    assert [s["status"] for s in summaries] == ["completed"] * 4
    logs = [p.read_text() for p in sorted(sweep_dir.glob("*/logs/rank0.log"))]
    built = [text for text in logs if "'cache_hit': False" in text]
    assert len(logs) == 4 and len(built) == 1, [t[-2000:] for t in logs]
    entries = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(entries) == 1, entries
