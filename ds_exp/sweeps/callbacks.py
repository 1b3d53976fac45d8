"""Split from ds_exp.sweeps.jobs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ds_exp.config.paths import sweep_job_names
from ds_exp.config.secrets import redact_text
from ds_exp.core.errors import ConfigError
from ds_exp.launch.callbacks import exit_on_error
from ds_exp.launch.storage import check_writable
from ds_exp.sweeps.jobs import check_job, sweep_jobs
from ds_exp.sweeps.report import PLAN_FILE, write_report
from ds_exp.sweeps.study_files import completed_trials, is_study_sweep


def check_sweep_start(config: DictConfig) -> None:
    """Before a sweep: writable, and not an earlier sweep's directory (unless its jobs are resumed)."""
    sweep_dir = Path(str(config.hydra.sweep.dir))
    check_writable(sweep_dir, "hydra.sweep.dir")

    if is_study_sweep(config):
        # an optuna study continues in its own directory: ds_exp/sweeps/optuna_study.py checks it is that study's
        return
    if config.get("resume") is None and sweep_dir.is_dir():
        jobs = sweep_job_names(sweep_dir)
        if jobs:
            raise ConfigError(
                f"hydra.sweep.dir={sweep_dir} already holds the jobs of a sweep ({', '.join(jobs[:5])}"
                f"{' ...' if len(jobs) > 5 else ''}); nothing was changed. Continue them with resume=auto, or "
                "leave hydra.sweep.dir unset for a fresh directory"
            )


SLURM_COMMANDS = ("sbatch", "srun")  # submitit submits with sbatch, and its SLURM executor needs srun on this PATH


def check_slurm_commands(config: DictConfig) -> None:
    """hydra/launcher=slurm on a machine without SLURM's commands: one message before anything is submitted or
    written (submitit's own is a traceback ending in `Could not detect "srun"`)."""
    if not str(config.hydra.launcher.get("_target_", "")).endswith(".SlurmLauncher"):
        return
    missing = [name for name in SLURM_COMMANDS if shutil.which(name) is None]
    if missing:
        raise ConfigError(
            f"hydra/launcher=slurm: {' and '.join(missing)} not found on this machine's PATH, so no SLURM job can be "
            "submitted from here; nothing was submitted. Run the sweep from a SLURM login node (or fix PATH), or "
            "here with hydra/launcher=local (submitit's local executor) or without hydra/launcher (one job after "
            "another)"
        )


class ValidateSweep(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        exit_on_error(lambda: check_slurm_commands(config))
        exit_on_error(lambda: check_sweep_start(config))

        jobs = sweep_jobs(config)
        if not jobs:
            return
        loader = GlobalHydra.instance().config_loader()
        problems = []
        for overrides in jobs:
            problems += check_job(loader, config, overrides)[1]
        if problems:
            print(
                f"ds_exp: error: the sweep was not started: {len(problems)} problem(s) in its {len(jobs)} jobs",
                file=sys.stderr,
            )
            for line in problems:
                print(f"  {redact_text(line)}", file=sys.stderr)  # a composition error may quote a value
            sys.exit(2)
        print(f"ds_exp: all {len(jobs)} jobs of the sweep are valid")


class SweepReport(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("dry_run"):
            return  # planned, not run: nothing to report
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_report(sweep_dir)

        if (sweep_dir / PLAN_FILE).is_file():  # probes that fail are results of the autotune sweep, not errors
            if not any(row["status"] == "completed" for row in rows):
                print("ds_exp: error: autotune: no probe completed; nothing to recommend", file=sys.stderr)
                sys.exit(1)
            return
        if is_study_sweep(config):  # a failed trial is part of a search; a study with no completed trial is not
            if not completed_trials(sweep_dir):
                print("ds_exp: error: no trial of the optuna study completed", file=sys.stderr)
                sys.exit(1)
            return
        failed = [row for row in rows if row["status"] != "completed"]
        if failed:
            print(f"ds_exp: error: {len(failed)} of {len(rows)} sweep jobs did not complete", file=sys.stderr)
            sys.exit(1)
