"""The run directory: checked before Hydra writes into it, so that no run overwrites another's files.

`CheckRunDir` (a Hydra callback, conf/config.yaml) runs before Hydra creates the run or sweep directory and
saves `.hydra/` into it:
* the directory must be writable (storage.check_writable);
* a directory that already holds a run is refused unless `resume` is given (a fresh run would overwrite its
  `.hydra/`, summary, export and checkpoints and append to its metrics);
* `resume` must name a usable checkpoint written with the same settings (ds_exp.resume): a refused resume
  changes nothing;
* a resumed run keeps the first attempt's `.hydra/` and saves its own config under `.hydra/resume-<time>/`.
Light: no torch, no deepspeed.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

from ds_exp.config.schema import Config, to_config
from ds_exp.console import report_user_error
from ds_exp.errors import ConfigError, DsExpError, Refused
from ds_exp.paths import sweep_job_names

# Files a run writes once per attempt that a restart from scratch (resume=auto with no checkpoint yet) must not
# append to: they are moved aside into attempts/<time>/ first.
ATTEMPT_FILES = ("metrics.jsonl", "generations.jsonl", "summary.json")


def holds_a_run(run_dir: Path, checkpoint_subdir: str) -> str | None:
    """What shows that `run_dir` holds a run (for messages), or None."""
    if not run_dir.is_dir():
        return None
    if (run_dir / "summary.json").is_file():
        summary = read_summary(run_dir)
        return (
            f"summary.json: status {summary.get('status')} at step {summary.get('steps')}"
            if summary is not None
            else "summary.json"
        )
    for name in ("metrics.jsonl", ".hydra/config.yaml", "ds_config.json"):
        if (run_dir / name).is_file():
            return name
    checkpoints = run_dir / checkpoint_subdir
    if checkpoints.is_dir() and any(checkpoints.glob("step*")):
        return f"{checkpoint_subdir}/"
    return None


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's summary.json, or None when it is missing or unreadable."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def completed_at(run_dir: Path) -> int | None:
    """The step at which summary.json says the run completed (None: it never did, or it says otherwise)."""
    summary = read_summary(run_dir)
    return summary.get("steps") if summary is not None and summary.get("status") == "completed" else None


def check_run_start(config: DictConfig) -> None:
    """Before a single run: the checks of the module docstring. May move .hydra's output for a resume."""
    from ds_exp.storage import check_writable

    run_dir = Path(str(config.hydra.run.dir))
    check_writable(run_dir, "hydra.run.dir")
    cfg = to_config(config)
    found = holds_a_run(run_dir, cfg.train.checkpoint_dir)
    lock_run_dir(run_dir)  # first: a live run in this directory is the reason to name
    try:
        _check_existing_run(config, cfg, run_dir, found)
    except BaseException:
        release_run_dir(run_dir, refused=True)
        raise
    claim_run_dir(run_dir)


def _check_existing_run(config: DictConfig, cfg: Config, run_dir: Path, found: str | None) -> None:
    if found is None:
        return
    if cfg.resume is None:
        raise ConfigError(
            f"hydra.run.dir={run_dir} already holds a run ({found}); nothing was changed. Continue it with "
            "resume=auto, or start a new run in another directory (leave hydra.run.dir unset for a fresh one)"
        )
    check_resume_target(cfg, run_dir)
    if (run_dir / ".hydra").is_dir() and config.hydra.output_subdir == ".hydra":
        with read_write(config.hydra), open_dict(config.hydra):  # the first attempt's config stays as it was
            config.hydra.output_subdir = f".hydra/resume-{time.strftime('%Y-%m-%d_%H-%M-%S')}"


def check_resume_target(cfg: Config, run_dir: Path) -> None:
    """The checkpoint `resume` names exists, is complete and was written with this run's settings."""
    from ds_exp.accelerator import decide_precision, detect_accelerator, supports_bf16
    from ds_exp.checkpoint import find_resume_checkpoint
    from ds_exp.config.ds_config import merged_ds_config
    from ds_exp.distributed import detect_launch
    from ds_exp.resume import check_resume, settings_of

    tag_dir = find_resume_checkpoint(cfg.resume, run_dir, cfg.train.checkpoint_dir)
    if tag_dir is None:
        return
    accelerator = detect_accelerator()
    precision = decide_precision(cfg.precision.dtype, accelerator, supports_bf16(accelerator))
    world = detect_launch(cfg.dist).world_size
    check_resume(cfg, tag_dir, settings_of(cfg, world, merged_ds_config(cfg), precision))
    check_global_batch(cfg, tag_dir, world)


def check_global_batch(cfg: Config, tag_dir: Path, world: int) -> None:
    """The one trajectory refusal that needs nothing heavy to decide (ds_exp.trajectory has the rest)."""
    from ds_exp.checkpoint import read_marker
    from ds_exp.trajectory import check

    saved = read_marker(tag_dir).get("trajectory")
    if saved:
        train = cfg.train
        batch = train.micro_batch_size * train.gradient_accumulation_steps * world
        check(cfg, {"global_batch": saved.get("global_batch")}, {"global_batch": batch, "data": None}, 0, tag_dir)


def check_sweep_start(config: DictConfig) -> None:
    """Before a sweep: writable, and not an earlier sweep's directory (unless its jobs are resumed)."""
    from ds_exp.storage import check_writable

    sweep_dir = Path(str(config.hydra.sweep.dir))
    check_writable(sweep_dir, "hydra.sweep.dir")
    from ds_exp.study_record import is_study_sweep

    if is_study_sweep(config):
        return  # an optuna study continues in its own directory: ds_exp/study.py checks it is that study's
    if config.get("resume") is None and sweep_dir.is_dir():
        jobs = sweep_job_names(sweep_dir)
        if jobs:
            raise ConfigError(
                f"hydra.sweep.dir={sweep_dir} already holds the jobs of a sweep ({', '.join(jobs[:5])}"
                f"{' ...' if len(jobs) > 5 else ''}); nothing was changed. Continue them with resume=auto, or "
                "leave hydra.sweep.dir unset for a fresh directory"
            )


def set_aside_attempt(run_dir: Path) -> Path | None:
    """Move the per-attempt files of an attempt that left no checkpoint into attempts/<time>/ (a restart from
    scratch then neither appends to its metrics nor replaces its summary). Returns where they went."""
    present = [run_dir / name for name in ATTEMPT_FILES if (run_dir / name).is_file()]
    if not present:
        return None
    target = run_dir / "attempts" / time.strftime("%Y-%m-%d_%H-%M-%S")
    target.mkdir(parents=True, exist_ok=True)
    for path in present:
        shutil.move(str(path), target / path.name)
    return target


# ------------------------------------------------------------------------------------ one live run per directory
LOCK = ".ds_exp.lock"
_locks: dict[Path, tuple[Any, bool]] = {}  # run directory -> (the open file this process locks, whether it made it)


def lock_run_dir(run_dir: Path) -> None:
    """Hold <run dir>/.ds_exp.lock (an exclusive flock) until release_run_dir or the process's end. A second process
    that finds it held stops at once, naming the holder (claim_run_dir writes who that is, once a run goes ahead);
    a lock left by a killed process is released by the kernel with it, so a stale lock never blocks anyone."""
    import fcntl
    import os

    run_dir = run_dir.absolute()
    if run_dir in _locks:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    while True:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, created = os.open(path, os.O_RDWR), False
            except FileNotFoundError:  # removed in between by a refused start that had created it
                continue
        handle = os.fdopen(fd, "r+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = handle.read().strip() or "another process, starting"
            handle.close()
            raise Refused(
                f"hydra.run.dir={run_dir} is in use by a live ds_exp run ({holder}); nothing was changed. Wait for "
                "it to end (or stop it), then resume=auto; or use another directory"
            ) from None
        try:  # the file we locked is still the one at the path (not one a refused start just removed)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        handle.close()
    _locks[run_dir] = (handle, created)


def claim_run_dir(run_dir: Path) -> None:
    """Write who holds the lock into it, once the run goes ahead (a refused start leaves the file as it was)."""
    import os
    import socket

    handle, _ = _locks[run_dir.absolute()]
    handle.seek(0)
    handle.truncate()
    handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()


def release_run_dir(run_dir: Path, *, refused: bool = False) -> None:
    """Let the lock go; a refused start also removes the lock file if it created it (nothing of it stays)."""
    entry = _locks.pop(run_dir.absolute(), None)
    if entry is not None:
        handle, created = entry
        if refused and created:
            (run_dir.absolute() / LOCK).unlink(missing_ok=True)  # while still held: see the inode check above
        handle.close()  # closing the file releases the lock


# --------------------------------------------------------------------------- the placeholder of ranks > 0
_placeholder: str | None = None


def rank_placeholder_overrides(args: list[str]) -> list[str]:
    """Hydra overrides that keep ranks > 0 of a torchrun / deepspeed / mpirun / srun launch out of outputs/.

    Every rank runs Hydra; only rank 0's run directory is real. The others get a placeholder directory in /tmp
    (removed by remove_rank_placeholder, and at exit) and learn rank 0's directory once torch.distributed is up.
    """
    import atexit
    import tempfile

    from ds_exp.distributed import launch_rank_from_env, launched_with_several_ranks

    global _placeholder
    if not launched_with_several_ranks():
        return []
    if "-m" in args or "--multirun" in args:
        raise SystemExit(
            "ds_exp: error: -m/--multirun under torchrun, mpirun, srun or the deepspeed launcher would run the whole "
            "sweep on every rank; use a submitit launcher with several tasks per node instead "
            "(hydra/launcher=slurm hydra.launcher.tasks_per_node=N)"
        )
    if launch_rank_from_env() == 0:
        return []
    _placeholder = tempfile.mkdtemp(prefix=f"ds_exp_rank{launch_rank_from_env()}_")
    atexit.register(remove_rank_placeholder)  # however the process ends, short of a SIGKILL
    return [f"hydra.run.dir={_placeholder}", "hydra.output_subdir=null", "hydra/job_logging=stdout"]


def remove_rank_placeholder() -> None:
    global _placeholder
    if _placeholder is not None:
        shutil.rmtree(_placeholder, ignore_errors=True)
        _placeholder = None


class CheckRunDir(Callback):
    """Hydra callback: run_dir's checks before Hydra creates the run / sweep directory or writes into it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _exit_on_error(lambda: check_run_start(config))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _exit_on_error(lambda: check_sweep_start(config))


def _exit_on_error(check: Any) -> None:
    try:
        check()
    except DsExpError as err:
        report_user_error(err)
        raise SystemExit(err.exit_code) from None
