"""A sweep's Hydra callbacks: `ValidateSweep` checks the directory and every job before launch; `SweepReport` writes the
report and fails when a job did. Whatever they raise stops the sweep."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ds_exp.config.paths import sweep_job_names
from ds_exp.config.place_checks import experiment_name_problem
from ds_exp.core.errors import ConfigError, RunFailed
from ds_exp.core.status import RunStatus
from ds_exp.launch.console import exit_on_error
from ds_exp.launch.lock import claim_sweep_dir, lock_sweep_dir, release_sweep_dir
from ds_exp.launch.run_dir import check_not_inside_a_live_dir
from ds_exp.launch.storage import check_writable
from ds_exp.sweeps.jobs import check_job, forget_resumed_jobs, keep_resumed_configs, own_job_dirs, sweep_jobs
from ds_exp.sweeps.report import PLAN_FILE, autotune_verdict, write_report
from ds_exp.sweeps.study_files import completed_trials, is_study_sweep


def check_sweep_start(config: DictConfig) -> None:
    """Before a sweep: writable, locked, not in a live run's or sweep's directory, not an earlier sweep's."""
    name_problem = experiment_name_problem(config.get("experiment_name"))
    if name_problem is not None:  # the sweep directory is named by it: it may lie outside outputs/
        raise ConfigError(name_problem)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    check_writable(sweep_dir, "hydra.sweep.dir")
    check_not_inside_a_live_dir(sweep_dir, "hydra.sweep.dir")
    lock_sweep_dir(sweep_dir)  # before looking: a sweep started a moment later finds it held, not free
    try:
        # an optuna study continues in its own directory: ds_exp/sweeps/optuna_study.py checks it is that study's
        if not is_study_sweep(config) and config.get("resume") is None and sweep_dir.is_dir():
            jobs = sweep_job_names(sweep_dir)
            if jobs:
                raise ConfigError(
                    f"hydra.sweep.dir={sweep_dir} already holds the jobs of a sweep ({', '.join(jobs[:5])}"
                    f"{' ...' if len(jobs) > 5 else ''}); nothing was changed. Continue them with resume=auto, or "
                    "leave hydra.sweep.dir unset for a fresh directory"
                )
    except BaseException:
        release_sweep_dir(sweep_dir)
        raise
    claim_sweep_dir(sweep_dir)


SLURM_COMMANDS = ("sbatch", "srun")  # submitit submits with sbatch, and its SLURM executor needs srun on this PATH


def check_slurm_commands(config: DictConfig) -> None:
    """hydra/launcher=slurm without SLURM's commands: one message before anything is submitted."""
    if not str(OmegaConf.select(config, "hydra.launcher._target_", default="")).endswith(".SlurmLauncher"):
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
        exit_on_error(lambda: check_slurm_commands(config), "checking SLURM's commands")
        exit_on_error(lambda: check_sweep_start(config), "checking the sweep directory")
        exit_on_error(lambda: self.validate(config), "validating the sweep's jobs")

    @staticmethod
    def validate(config: DictConfig) -> None:
        jobs = sweep_jobs(config)
        if not jobs:
            return
        loader = GlobalHydra.instance().config_loader()
        problems = []
        forget_resumed_jobs()
        for num, overrides in enumerate(jobs):  # numbered as Hydra's basic sweeper numbers them
            problems += check_job(loader, config, overrides, num, continues=True)[1]
        if problems:  # told redacted (a composition error may quote a value)
            raise ConfigError(
                [f"the sweep was not started: {len(problems)} problem(s) in its {len(jobs)} jobs", *problems]
            )
        keep_resumed_configs()  # the resumed jobs' own configs, which Hydra's launch would write over
        print(f"ds_exp: all {len(jobs)} jobs of the sweep are valid")


class SweepReport(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        exit_on_error(
            lambda: self.report(config), "writing the sweep report", after="the jobs' own files are as they left them"
        )

    @staticmethod
    def report(config: DictConfig) -> None:
        if config.get("dry_run"):
            return  # planned, not run: nothing to report
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_report(sweep_dir, own_job_dirs(config, sweep_dir))
        if (sweep_dir / PLAN_FILE).is_file():  # probes that fail are results of the autotune sweep, not errors
            problem = autotune_verdict(sweep_dir, rows)
            if problem is not None:
                raise RunFailed(f"autotune: {problem}")
            return
        if is_study_sweep(config):  # a failed trial is part of a search; a study with no completed trial is not
            if not completed_trials(sweep_dir):
                raise RunFailed("no trial of the optuna study completed")
            return
        failed = [row for row in rows if row["status"] != RunStatus.COMPLETED]
        if failed:
            raise RunFailed(f"{len(failed)} of {len(rows)} sweep jobs did not complete")
