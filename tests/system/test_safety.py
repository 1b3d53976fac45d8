"""Nothing lost, no hang, a readable console: run directories that other runs cannot overwrite, resumes that
change nothing when refused, rotation that only deletes its own checkpoints, signals obeyed before training
starts, and a single process on any free port (the console: tests/integration/test_console.py)."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.training import FAST, REPO, free_port, launch, train_here, user_env

SAVED = [*FAST, "train.save_final_checkpoint=true", "train.export=true"]


def checksums(root: Path) -> dict[str, str]:
    """Every file under `root` with its sha256: what "changes nothing" is checked against (the run directory's
    lock included: a refused start leaves it as it was)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir):
    run = train_here(tmp_path_factory.mktemp("finished") / "run", *SAVED, cache_dir=cache_dir)
    assert run.ok, run.explain()
    return run


def test_a_fresh_run_into_a_finished_runs_directory_is_refused_and_changes_nothing(finished, cache_dir):
    before = checksums(finished.run_dir)
    again = train_here(finished.run_dir, *SAVED, "train.max_steps=3", cache_dir=cache_dir)
    assert again.proc.returncode == 2, again.explain()
    assert "already holds a run (summary.json: status completed at step 8)" in again.proc.stderr
    assert "resume=auto" in again.proc.stderr and "Traceback" not in again.proc.stderr
    assert checksums(finished.run_dir) == before


def test_resume_auto_of_a_finished_run_has_nothing_to_do_and_changes_nothing(finished, cache_dir):
    before = checksums(finished.run_dir)
    logs = {name: (finished.run_dir / name).read_text() for name in ("ds_exp.log", "logs/rank0.log")}
    again = train_here(finished.run_dir, *SAVED, "resume=auto", cache_dir=cache_dir)
    assert again.ok, again.explain()
    assert "is complete at step 8 of 8" in again.proc.stdout and "nothing to do" in again.proc.stdout
    after = checksums(finished.run_dir)
    # the same files, byte for byte; this attempt only added its own .hydra/resume-<time>/ and log lines, and
    # named itself in the directory's lock while it held it
    changed = {k for k in before if after.get(k) != before[k]}
    assert changed <= set(logs) | {".ds_exp.lock"}, changed
    for name, text in logs.items():  # appended to, never truncated
        assert (finished.run_dir / name).read_text().startswith(text), name
    assert all(k in before or k.startswith((".hydra/resume-", "logs/")) for k in after), set(after) - set(before)


@pytest.mark.parametrize(
    ("change", "launcher", "expected"),
    [
        ("lora.dim=8", "single", "- lora: none in the checkpoint"),
        ("model.arch.hidden_size=64", "single", "- model: "),
        ("lora.dim=8", "torchrun", "- lora: none in the checkpoint"),  # a world size, stage, offload change is not
    ],
)
def test_a_resume_with_other_shapes_is_refused_and_changes_nothing(finished, cache_dir, change, launcher, expected):
    before = checksums(finished.run_dir)
    nproc = 2 if launcher == "torchrun" else 1
    again = launch(
        finished.run_dir,
        *SAVED,
        "train.max_steps=16",
        "resume=auto",
        change,
        launcher=launcher,
        nproc=nproc,
        cache_dir=cache_dir,
    )
    assert again.proc.returncode != 0, again.explain()
    err = again.proc.stderr
    assert "was written with other settings, so it cannot be loaded" in err and expected in err, err[-3000:]
    if launcher == "single":  # torchrun reports a failed worker with a traceback of its own
        assert "Traceback" not in err
    assert checksums(finished.run_dir) == before  # .hydra, summary (still completed), ds_config.json


def test_a_resume_that_trains_on_keeps_the_first_attempts_config(tmp_path, cache_dir):
    first = train_here(tmp_path / "run", *SAVED, cache_dir=cache_dir)
    assert first.ok, first.explain()
    original = (first.run_dir / ".hydra" / "overrides.yaml").read_text()
    longer = train_here(first.run_dir, *SAVED, "train.max_steps=12", "resume=auto", cache_dir=cache_dir)
    assert longer.ok, longer.explain()
    assert (first.run_dir / ".hydra" / "overrides.yaml").read_text() == original
    (resumed_config,) = (first.run_dir / ".hydra").glob("resume-*/overrides.yaml")
    assert "train.max_steps=12" in resumed_config.read_text()
    assert [r["step"] for r in longer.records("train")] == list(range(1, 13))  # no step twice in metrics.jsonl


def test_rotation_never_deletes_another_runs_checkpoints(tmp_path, cache_dir):
    other = train_here(tmp_path / "other", *SAVED, "train.save_every=4", "train.keep_last=0", cache_dir=cache_dir)
    assert other.ok, other.explain()
    shared = other.run_dir / "checkpoints"
    theirs = {k: v for k, v in checksums(shared).items() if k.startswith("step")}
    assert sorted(p.name for p in shared.glob("step*")) == ["step4", "step8"]
    outside = ("train.allow_outside_run_dir=true", f"train.checkpoint_dir={shared}", "train.export=false")
    mine = train_here(
        tmp_path / "mine",
        *SAVED,
        *outside,
        "train.max_steps=7",
        "train.save_every=3",
        "train.keep_last=1",
        cache_dir=cache_dir,
    )
    assert mine.ok, mine.explain()
    # rotation deleted this run's step3 and step6 only; the other run's checkpoints are there, byte for byte
    assert sorted(p.name for p in shared.glob("step*")) == ["step4", "step7", "step8"]
    assert {k: v for k, v in checksums(shared).items() if k in theirs} == theirs
    # and a checkpoint of the other run is never overwritten by this one
    clash = train_here(tmp_path / "clash", *SAVED, *outside, "train.max_steps=4", cache_dir=cache_dir)
    assert clash.proc.returncode == 1, clash.explain()
    assert f"{shared / 'step4'} is a complete checkpoint of another run" in clash.proc.stderr
    assert {k: v for k, v in checksums(shared).items() if k in theirs} == theirs


def test_a_damaged_checkpoint_names_the_previous_complete_one(tmp_path, cache_dir):
    run = train_here(tmp_path / "run", *SAVED, "train.save_every=4", "train.export=false", cache_dir=cache_dir)
    assert run.ok, run.explain()
    newest = run.run_dir / "checkpoints" / "step8"
    weights = next(newest.glob("*model_states.pt"))
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated, as by a full disk or a copy cut short
    summary = (run.run_dir / "summary.json").read_bytes()
    again = train_here(run.run_dir, *SAVED, "train.max_steps=12", "resume=auto", cache_dir=cache_dir)
    assert again.proc.returncode == 2, again.explain()
    assert f"{newest} cannot be read" in again.proc.stderr and "Traceback" not in again.proc.stderr
    assert f"resume={run.run_dir / 'checkpoints' / 'step4'}" in again.proc.stderr
    assert (run.run_dir / "summary.json").read_bytes() == summary  # the refused resume rewrote nothing


def test_a_single_process_does_not_need_port_29500(tmp_path, cache_dir):
    with socket.socket() as busy:
        with contextlib.suppress(OSError):  # taken by something else already: just as good
            busy.bind(("127.0.0.1", 29500))
            busy.listen()
        env = {k: v for k, v in user_env().items() if k != "MASTER_PORT"}
        args = [*FAST, "train.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}"]
        proc = subprocess.run(
            [sys.executable, "-m", "ds_exp", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _start(tmp_path: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ds_exp", *args],
        cwd=tmp_path,
        env={**user_env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(proc: subprocess.Popen, text: str, timeout: float) -> str:
    """Read the process's output until `text` appears; returns what was read."""
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen:
        assert time.monotonic() < deadline, f"{text!r} did not appear within {timeout} s:\n{seen[-3000:]}"
        line = proc.stdout.readline()
        assert line or proc.poll() is None, f"exited early ({proc.returncode}):\n{seen[-3000:]}"
        seen += line
    return seen


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_waiting_for_its_peers_says_so_and_obeys_sigterm(tmp_path, cache_dir, rank):
    tmpdir = tmp_path / "tmp"  # where rank 1's placeholder run directory goes: it must not be left behind
    tmpdir.mkdir()
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_PORT": str(free_port())}
    env["TMPDIR"] = str(tmpdir)
    args = [*FAST, f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}"]
    proc = _start(tmp_path, args, env)  # the other rank never comes
    try:
        _wait_for(proc, "for the 2 ranks to meet at 127.0.0.1:", timeout=120)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        output = proc.communicate(timeout=60)[0]
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert took < 10, f"{took:.0f} s from SIGTERM to exit"
    assert "Traceback" not in output
    # torch's compile cache (made there when DeepSpeed's shared-memory op is compiled) is a cache, not a leftover
    left = [path for path in tmpdir.iterdir() if not path.name.startswith("torchinductor_")]
    assert not left, left


def test_sigterm_during_tokenization_stops_within_seconds(tmp_path):
    args = [
        "data.synthetic.num_train=400000",  # tokenizing this takes half a minute here
        f"hydra.run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    proc = _start(tmp_path, args, {"MASTER_PORT": str(free_port())})
    try:
        _wait_for(proc, "ds_exp: launch single", timeout=120)
        deadline = time.monotonic() + 120  # piped, tokenizing draws no bar: its build directory says it started
        while not list((tmp_path / "cache").glob(".*.tmp-*")):
            assert time.monotonic() < deadline and proc.poll() is None, "tokenizing never started"
            time.sleep(0.1)
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        output = proc.communicate(timeout=120)[0]
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert took < 15, f"{took:.0f} s from SIGTERM to exit"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "stopped" and "before the first training step" in summary["error"]
    cache = tmp_path / "cache"
    assert not list(cache.glob(".*tmp*")), "a half-built cache entry was left behind"


def test_keep_last_zero_says_what_it_means(tmp_path, cache_dir):
    run = train_here(tmp_path / "run", *FAST, "train.keep_last=0", "train.max_steps=2", cache_dir=cache_dir)
    assert run.ok, run.explain()
    assert "train.keep_last=0: no checkpoint is ever deleted" in run.proc.stderr + run.proc.stdout


def test_the_placeholder_of_a_refused_rank_is_removed(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**user_env(), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TMPDIR": str(tmpdir)}
    proc = subprocess.run(
        [sys.executable, "-m", "ds_exp", "train.micro_batch_size=0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    # nothing but the claim that this launch's ranks said the message once (ds_exp/launch/console.py first_to_say)
    left = sorted(str(p.relative_to(tmpdir)) for p in tmpdir.rglob("*") if p.is_file())
    assert [Path(name).parent for name in left] == [Path(f"ds_exp-{os.getuid()}/said")], left
    assert os.path.isdir(REPO)


# ------------------------------------------------------------------ issue 21 §3: sweeps and the run-directory lock


@contextlib.contextmanager
def held_lock(directory: Path, holder: str = "host elsewhere, pid 4242, since now"):
    """<directory>/.ds_exp.lock held by this test process, as a live ds_exp run or sweep holds it."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".ds_exp.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(holder + "\n")
        handle.flush()
        yield


def _dry_sweep(tmp_path: Path, sweep: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_exp",
            "-m",
            "zero=stage0,stage1",
            "dry_run=true",
            *overrides,
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_second_sweep_into_a_live_sweeps_directory_is_refused_and_changes_nothing(tmp_path):
    """Two sweeps started together into one directory both passed the 'already holds a sweep' check: the sweep's
    lock is taken before that check now. The first sweep is stood in for by this process holding the lock."""
    sweep = tmp_path / "sweep"
    with held_lock(sweep):
        before = checksums(sweep)
        second = _dry_sweep(tmp_path, sweep)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert "is in use by a live ds_exp sweep (host elsewhere, pid 4242" in second.stderr
        assert "Traceback" not in second.stderr
        assert checksums(sweep) == before and sorted(p.name for p in sweep.iterdir()) == [".ds_exp.lock"]


def test_a_sweep_job_never_writes_into_a_directory_that_holds_another_run(tmp_path):
    sweep = tmp_path / "sweep"
    other = sweep / "1"  # a run that is no job of a sweep (no .hydra/): a single run put there, or a copied one
    other.mkdir(parents=True)
    (other / "metrics.jsonl").write_text('{"type": "train", "step": 1, "loss": 5.0}\n')
    before = checksums(sweep)
    proc = _dry_sweep(tmp_path, sweep)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{other.relative_to(tmp_path)} already holds a run (metrics.jsonl); nothing was launched" in proc.stderr
    assert checksums(sweep) == before and sorted(p.name for p in sweep.iterdir()) == ["1"]  # no job 0 either


def test_a_run_inside_a_live_sweeps_directory_is_refused(tmp_path):
    """A single run into a job's directory of a live sweep would be overwritten by that job (or train into it)."""
    sweep = tmp_path / "sweep"
    with held_lock(sweep):
        proc = run_dry(tmp_path, f"hydra.run.dir={sweep / '3'}")
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert f"is inside {sweep}, the directory of a live ds_exp sweep or run (host elsewhere" in proc.stderr
        assert sorted(p.name for p in sweep.iterdir()) == [".ds_exp.lock"]  # not even the job's directory


def run_dry(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ds_exp", "dry_run=true", *overrides],
        cwd=tmp_path,
        env={**user_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_finished_run_whose_lock_is_a_directory_is_refused_and_changes_nothing(finished, tmp_path, cache_dir):
    """An error inside the pre-run checks other than ds_exp's own used to become a Hydra warning: the run went on
    and replaced the finished run's .hydra/ and summary.json."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(finished.run_dir, run_dir)
    assert not (run_dir / ".ds_exp.lock").exists()  # the run ended: its lock file went with it
    (run_dir / ".ds_exp.lock").mkdir()
    before = checksums(run_dir)
    # the command line: its Hydra callback (CheckRunDir) is where such an error became a warning
    again = launch(run_dir, *SAVED, "resume=auto", "train.max_steps=12", cache_dir=cache_dir, cwd=tmp_path)
    assert again.proc.returncode == 2, again.explain()
    assert f"{run_dir / '.ds_exp.lock'} is a directory, not ds_exp's lock file" in again.proc.stderr
    assert "Traceback" not in again.proc.stderr
    assert checksums(run_dir) == before


@pytest.mark.parametrize("kind", ["dangling link", "link to a file", "directory", "fifo", "no flock"])
def test_every_way_the_lock_can_fail_is_one_message_never_a_hang(tmp_path, monkeypatch, kind):
    import errno
    import fcntl

    from ds_exp.core.errors import Refused
    from ds_exp.launch import lock as rd

    run = tmp_path / "run"
    run.mkdir()
    lock = run / ".ds_exp.lock"
    expected = {
        "dangling link": f"{lock} is a symbolic link (to {tmp_path / 'gone'}, which does not exist)",
        "link to a file": f"{lock} is a symbolic link (to {tmp_path / 'file'})",
        "directory": f"{lock} is a directory, not ds_exp's lock file",
        "fifo": f"{lock} is not a regular file",
        "no flock": f"the file system of {lock} does not support file locks",
    }[kind]
    if kind == "dangling link":  # made `ds_exp hydra.run.dir=R` spin at 100% CPU forever
        lock.symlink_to(tmp_path / "gone")
    elif kind == "link to a file":
        (tmp_path / "file").write_text("")
        lock.symlink_to(tmp_path / "file")
    elif kind == "directory":
        lock.mkdir()
    elif kind == "fifo":
        os.mkfifo(lock)
    else:

        def no_flock(handle, operation):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

        monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(Refused) as err:
        rd.lock_run_dir(run)
    assert str(err.value).startswith(f"hydra.run.dir={run}: {expected}"), err.value
    assert "nothing was changed" in str(err.value)
    assert run.absolute() not in rd._locks
    if kind == "no flock":
        assert not lock.exists()  # the lock file it made is not left behind


@pytest.mark.parametrize("hook", ["on_run_start", "on_multirun_start", "validate", "report"])
def test_every_callback_check_fails_closed_whatever_it_raises(monkeypatch, capsys, hook):
    """Hydra 1.3 catches what a callback raises and only warns: an unexpected error in a check must still stop."""
    from omegaconf import OmegaConf

    from ds_exp.launch import callbacks as run_callbacks
    from ds_exp.sweeps import callbacks as sweep_callbacks

    def broken(*args, **kwargs):
        raise KeyError("something nobody expected")

    config = OmegaConf.create({"dry_run": False, "hydra": {"sweep": {"dir": "x"}, "sweeper": {}}})
    callback: object
    if hook == "on_run_start":
        monkeypatch.setattr(run_callbacks, "check_run_start", broken)
        callback, method = run_callbacks.CheckRunDir(), hook
    elif hook == "on_multirun_start":
        monkeypatch.setattr(sweep_callbacks, "check_sweep_start", broken)
        callback, method = sweep_callbacks.ValidateSweep(), hook
    elif hook == "validate":
        monkeypatch.setattr(sweep_callbacks, "check_sweep_start", lambda config: None)
        monkeypatch.setattr(sweep_callbacks, "sweep_jobs", broken)
        callback, method = sweep_callbacks.ValidateSweep(), "on_multirun_start"
    else:
        monkeypatch.setattr(sweep_callbacks, "own_job_dirs", broken)
        callback, method = sweep_callbacks.SweepReport(), "on_multirun_end"
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exited:
        getattr(callback, method)(config=config)
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("ds_exp: error: ") and "(KeyError: 'something nobody expected')" in err, err
    assert "Traceback" not in err
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(SystemExit):
        getattr(callback, method)(config=config)
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.slow
def test_the_sweep_report_lists_only_the_sweeps_own_jobs(tmp_path, cache_dir):
    """A sweep continued (resume=auto) in a directory that holds more jobs than it runs reports its own."""
    sweep = tmp_path / "sweep"
    for job in ("0", "1", "2"):  # an earlier sweep's jobs that never trained (no checkpoint: job 0 starts over)
        (sweep / job / ".hydra").mkdir(parents=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- train.seed={job}\n")
        (sweep / job / ".hydra" / "config.yaml").write_text("{}\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_exp",
            "-m",
            *FAST,
            "train.max_steps=2",
            "train.seed=0",
            "resume=auto",
            f"data.cache_dir={cache_dir}",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with (sweep / "report.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "completed")]
