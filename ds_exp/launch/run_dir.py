"""The run directory, checked before Hydra writes into it (CheckRunDir) so no run overwrites another's; a resume keeps
the first `.hydra/` and saves its own under `.hydra/resume-<time>/`. Light."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ds_exp.config.command_line import command, override
from ds_exp.config.place_checks import chdir_problems, experiment_name_problem
from ds_exp.config.schema import Config, to_config
from ds_exp.core.errors import ConfigError, Refused
from ds_exp.core.status import RunStatus
from ds_exp.launch.console import say
from ds_exp.launch.environment import detect_launch, launch_rank_from_env, launched_with_several_ranks
from ds_exp.launch.lock import (
    LOCK,
    _not_a_lock_file,
    claim_run_dir,
    live_ancestor,
    live_holder,
    lock_run_dir,
    made_here,
    made_run_dirs,
    release_run_dir,
)
from ds_exp.launch.run_config import (
    continue_run_config,
    holds_a_run,
    named_run_dir,
    read_summary,
    resume_note,
    task_overrides,
)
from ds_exp.launch.storage import check_writable
from ds_exp.resume.settings import check_resume_target
from ds_exp.resume.store import complete_checkpoints

# per-attempt files a restart from scratch must not append to: moved aside into attempts/<time>/ first
ATTEMPT_FILES = ("metrics.jsonl", "generations.jsonl", "summary.json", "plots/loss.png")


def completed_at(run_dir: Path) -> int | None:
    """The step at which summary.json says the run completed (None: it never did, or it says otherwise)."""
    summary = read_summary(run_dir)
    return summary.get("steps") if summary is not None and summary.get("status") == RunStatus.COMPLETED else None


def check_run_start(config: DictConfig) -> None:
    """Before a single run: the module docstring's checks; a resume moves .hydra's output and takes its run's config."""
    name_problem = experiment_name_problem(config.get("experiment_name"))
    if name_problem is not None:  # before its directory is looked at: it may lie outside outputs/
        raise ConfigError(name_problem)
    run_dir = Path(str(config.hydra.run.dir))
    named = named_run_dir(config)
    if config.get("resume") == "auto" and named is None:  # rank 0's (a rank > 0's directory is named for it)
        raise ConfigError(nothing_to_resume(run_dir, str(OmegaConf.select(config, "train.checkpoint_dir"))))
    check_writable(run_dir, "hydra.run.dir")
    if config.get("resume") is not None and named is not None:
        changed = continue_run_config(config, named, task_overrides(config))
        if changed is not None and launch_rank_from_env() == 0:
            print(f"ds_exp: {resume_note(named, changed)}", file=sys.stderr)
    cfg = to_config(config)
    moved = chdir_problems(cfg, bool(OmegaConf.select(config, "hydra.job.chdir", default=False)))
    if moved:
        raise ConfigError(moved)
    check_not_inside_a_live_dir(run_dir, "hydra.run.dir")
    if named is None:  # Hydra named it by the second: another run may have started in the same one
        run_dir = _lock_a_fresh_dir(config, run_dir, cfg.train.checkpoint_dir)
    else:
        lock_run_dir(run_dir)  # first: a live run in this directory is the reason to name
    try:
        found = holds_a_run(run_dir, cfg.train.checkpoint_dir)
        if found is not None and cfg.resume is None:
            raise ConfigError(
                f"hydra.run.dir={run_dir} already holds a run ({found}); nothing was changed. Continue it with "
                "resume=auto, or start a new run in another directory (leave hydra.run.dir unset for a fresh one)"
            )
        if found is not None:
            check_resume_target(cfg, run_dir, detect_launch(cfg.dist).world_size)
            if (run_dir / ".hydra").is_dir() and config.hydra.output_subdir == ".hydra":
                with read_write(config.hydra), open_dict(config.hydra):  # the first attempt's config stays as it was
                    config.hydra.output_subdir = f".hydra/resume-{time.strftime('%Y-%m-%d_%H-%M-%S')}"
    except BaseException:
        release_run_dir(run_dir, refused=True)
        raise
    claim_run_dir(run_dir)


def nothing_to_resume(new_dir: Path, checkpoint_subdir: str, shown: int = 3) -> str:
    """resume=auto in a new directory: where it looked, and the experiment's resumable runs with their commands."""
    runs = []
    parent = new_dir.parent
    for candidate in sorted(parent.iterdir(), reverse=True) if parent.is_dir() else []:
        found = complete_checkpoints(candidate / checkpoint_subdir) if candidate.is_dir() else []
        if found:
            summary = read_summary(candidate) or {}
            status = f", {summary['status']}" if summary.get("status") else ""
            again = command("python -m ds_exp", override("hydra.run.dir", _shown(candidate)), "resume=auto")
            runs.append(f"{again}   # {found[-1].name}{status}")
        if len(runs) == shown:
            break
    head = (
        f"resume=auto continues the run in hydra.run.dir, and none was given: this run would start in a new "
        f"directory ({_shown(new_dir)}), where there is nothing to resume; nothing was started."
    )
    if not runs:
        return (
            f"{head} No run in {_shown(parent)} has a complete checkpoint. Name the run directory to continue "
            "(python -m ds_exp hydra.run.dir=<run dir> resume=auto), or leave resume=auto out to start fresh"
        )
    newest = "the newest run with a checkpoint" if len(runs) == 1 else f"the {len(runs)} newest runs with a checkpoint"
    return f"{head} Continue {newest} in {_shown(parent)}:\n" + "\n".join(runs) + "\nor leave resume=auto out"


def _shown(path: Path) -> str:
    """A path as a command line gives it: relative to the working directory when it is inside it."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _lock_a_fresh_dir(config: DictConfig, run_dir: Path, checkpoint_subdir: str) -> Path:
    """Lock the directory Hydra chose, or the first free `<date_time>_N` beside it when another run holds it."""
    base = run_dir
    for n in range(1, 1000):
        try:
            lock_run_dir(run_dir)
        except Refused:
            if live_holder(run_dir) is None:  # not another run: its own message
                raise
        else:
            if holds_a_run(run_dir, checkpoint_subdir) is None:
                break
            release_run_dir(run_dir, refused=True)
        run_dir = base.with_name(f"{base.name}_{n}")
    if run_dir != base:
        with read_write(config.hydra):
            config.hydra.run.dir = str(run_dir)
    return run_dir


def check_not_inside_a_live_dir(directory: Path, key: str) -> None:
    live = live_ancestor(directory)
    if live is not None:
        parent, holder = live
        raise Refused(
            f"{key}={directory} is inside {parent}, the directory of a live ds_exp sweep or run ({holder}); nothing "
            "was changed. A job of that sweep may be about to write there: use a directory outside it, or wait for "
            "it to end"
        )


# what a run writes before its first step besides Hydra's files: a refused run that made its directory removes them
SETUP_FILES = ("logs", "ds_config.json")


def remove_refused_attempt(run_dir: Path, output_subdir: str | None, log_file: str) -> None:
    """A run refused before any work leaves nothing: its resume-<time>/, and a directory it made goes altogether."""
    if output_subdir and output_subdir.startswith(".hydra/resume-"):
        shutil.rmtree(run_dir / output_subdir, ignore_errors=True)
    if not made_here(run_dir):
        return
    if output_subdir:
        shutil.rmtree(run_dir / output_subdir, ignore_errors=True)
    (run_dir / log_file).unlink(missing_ok=True)
    for name in SETUP_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    release_run_dir(run_dir, refused=True)  # the lock file, then the directories it made, if empty now


def leave_quietly_before_start(signum: int, frame: FrameType | None) -> None:
    """A stop before the session: the run's directories this process made go, exit 128 + the signal, quietly."""
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    subdir, log_file = (hydra_cfg.output_subdir, f"{hydra_cfg.job.name}.log") if hydra_cfg else (".hydra", "ds_exp.log")
    for run_dir in made_run_dirs():
        remove_refused_attempt(run_dir, subdir, log_file)
    remove_rank_placeholder()
    if signum == signal.SIGINT:
        say(["ds_exp: interrupted"])
    sys.stderr.flush()
    os._exit(128 + signum)


@contextlib.contextmanager
def stop_before_start() -> Iterator[None]:
    """Around a launch's rank's command: a stop signal leaves nothing until the session installs its own handlers."""
    if not launched_with_several_ranks():
        yield
        return
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {signum: signal.signal(signum, leave_quietly_before_start) for signum in stops}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def check_job_dir(cfg: Config, job_dir: Path, sweep_dir: Path, *, runs_here: bool = False) -> None:
    """A sweep job's directory, checked like a run's before launch (`runs_here`: its resume checkpoint too)."""
    if job_dir.absolute() == sweep_dir.absolute():
        raise ConfigError(
            f"hydra.sweep.subdir puts the job in the sweep directory itself ({job_dir}); give each job its own "
            "subdirectory (the default hydra.sweep.subdir=${hydra.job.num})"
        )
    problem = _not_a_lock_file(job_dir / LOCK, job_dir, "")
    if problem is not None:
        raise problem
    holder = live_holder(job_dir)
    if holder is not None:
        raise Refused(
            f"{job_dir} is in use by a live ds_exp run ({holder}); nothing was launched. Wait for it to end, or use "
            "another hydra.sweep.dir"
        )
    found = holds_a_run(job_dir, cfg.train.checkpoint_dir)
    if found is not None and cfg.resume is None:
        raise ConfigError(
            f"{job_dir} already holds a run ({found}); nothing was launched. Continue it with resume=auto, or use "
            "another hydra.sweep.dir (leave it unset for a fresh one)"
        )
    if found is not None and runs_here:
        check_resume_target(cfg, job_dir, detect_launch(cfg.dist).world_size)


def set_aside_attempt(run_dir: Path) -> Path | None:
    """Move the per-attempt files of an attempt that left no checkpoint into attempts/<time>/; where they went."""
    present = [run_dir / name for name in ATTEMPT_FILES if (run_dir / name).is_file()]
    if not present:
        return None
    target = run_dir / "attempts" / time.strftime("%Y-%m-%d_%H-%M-%S")
    target.mkdir(parents=True, exist_ok=True)
    for path in present:
        shutil.move(str(path), target / path.name)
    return target


_placeholder: str | None = None


def rank_placeholder_overrides(args: list[str]) -> list[str]:
    """Overrides that put ranks > 0 in a placeholder in /tmp: only rank 0's run directory is real."""
    global _placeholder
    if not launched_with_several_ranks():
        return []
    if "-m" in args or "--multirun" in args:
        raise ConfigError(  # every rank hits it: printed once (ds_exp.launch.console.first_to_say)
            "-m/--multirun under torchrun, mpirun, srun or the deepspeed launcher would run the whole "
            "sweep on every rank; use a submitit launcher with several tasks per node instead "
            "(hydra/launcher=slurm hydra.launcher.tasks_per_node=N)"
        )
    if launch_rank_from_env() == 0:
        return []
    _placeholder = tempfile.mkdtemp(prefix=f"ds_exp_rank{launch_rank_from_env()}_")
    atexit.register(remove_rank_placeholder)  # however the process ends, short of a SIGKILL
    return [f"hydra.run.dir={_placeholder}", "hydra.output_subdir=null", "hydra/job_logging=ds_exp_console"]


def remove_rank_placeholder() -> None:
    global _placeholder
    if _placeholder is not None:
        shutil.rmtree(_placeholder, ignore_errors=True)
        _placeholder = None
