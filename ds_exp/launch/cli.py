"""The one entry point: `python -m ds_exp ...` and the `ds-exp` console script. Module level is light (torch and
deepspeed only in run_job); importing it patches nothing (`prepare_composition` is installed where composing)."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import hydra_plugins
from ds_exp.config.config_files import check_config_files
from ds_exp.config.override_checks import check_list_items_when_composing, quote_one_value_lists
from ds_exp.config.paths import PACKAGE_DIR, conf_dir
from ds_exp.config.resolvers import register_resolvers
from ds_exp.config.schema import register_configs
from ds_exp.config.secrets import hide_secret_overrides, redact_text, register_secrets
from ds_exp.core import compat
from ds_exp.core.errors import ConfigError, DsExpError, first_line
from ds_exp.core.status import RunStatus
from ds_exp.launch.console import entry_point, report_error
from ds_exp.launch.environment import detect_launch, launch_env_problems, launch_rank_from_env
from ds_exp.launch.experiment_file import wants_experiment_file, write_experiment_main
from ds_exp.launch.help import main as print_help
from ds_exp.launch.help import wants_help
from ds_exp.launch.hub import check_hub
from ds_exp.launch.run_config import finish_job_attempt, take_job_config
from ds_exp.launch.run_dir import rank_placeholder_overrides, remove_refused_attempt, stop_before_start
from ds_exp.launch.run_logging import hold_library_logs
from ds_exp.launch.validation import validate_job

log = logging.getLogger("ds_exp")

_LOCAL_RANK_FLAG = re.compile(r"^--local[_-]rank(=(\d+))?$")


def strip_local_rank(argv: list[str]) -> list[str]:
    """Drop the `--local_rank` the deepspeed launcher appends (Hydra rejects it), keeping its value in LOCAL_RANK."""
    kept: list[str] = []
    args = iter(argv)
    for arg in args:
        match = _LOCAL_RANK_FLAG.match(arg)
        if not match:
            kept.append(arg)
            continue
        value = match.group(2) if match.group(1) else next(args, None)
        if value is not None and value.isdigit():
            os.environ.setdefault("LOCAL_RANK", value)
    return kept


def run_job(composed: DictConfig) -> dict[str, Any]:
    """A resuming sweep job runs the config its sweep kept for it, and puts the earlier .hydra/ files back after."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if not (in_multirun() and composed.get("resume") is not None):
        return _run_job(composed, run_dir)
    first_rank = detect_launch().is_main  # a submitit job's ranks all run this: one of them moves files
    if not take_job_config(composed, run_dir, first_rank=first_rank):
        return _run_job(composed, run_dir)
    try:
        return _run_job(composed, run_dir)
    finally:
        if first_rank:
            finish_job_attempt(run_dir)


def _run_job(composed: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Typed, validated (data rows too), then planned or trained: heavy imports only past validation."""
    # the run's own overrides (the command line's, or a sweep job's) must be ones it obeys
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    try:
        cfg = validate_job(composed, overrides, run_dir=run_dir)
        from ds_exp.data.pipeline import count_train_examples  # datasets: only for a config that holds

        check_hub(cfg.model, dry_run=cfg.dry_run)  # no hub to reach: one message now, not transformers' retries
        # the data's rows read and checked (a bad row is its file:line) before torch and DeepSpeed take their seconds
        train_examples = count_train_examples(cfg.data)
    except DsExpError:
        if HydraConfig.initialized() and not in_multirun():
            hydra_cfg = HydraConfig.get()
            remove_refused_attempt(run_dir, hydra_cfg.output_subdir, f"{hydra_cfg.job.name}.log")
        raise
    if launch_rank_from_env() == 0 and (note := unnamed_experiment_note(cfg.experiment_name)):
        log.warning(note)
    compat.import_deepspeed_without_mlflow()  # DeepSpeed would import all of mlflow (the extra) for nothing
    if cfg.dry_run:
        from ds_exp.tools.dry_run import dry_run

        return dry_run(cfg, run_dir, train_examples)
    from ds_exp.train.recipe import recipe_main

    return recipe_main(cfg, run_dir)


def unnamed_experiment_note(experiment_name: str) -> str | None:
    """An experiment file that does not set experiment_name: its runs are named `default` like any other."""
    choice = HydraConfig.get().runtime.choices.get("experiment") if HydraConfig.initialized() else None
    if not choice or experiment_name != "default":
        return None
    return (
        f"experiment={choice} does not set experiment_name, so its outputs, wandb group and optuna study are named "
        f"`default`; add `experiment_name: {choice}` to its file"
    )


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def hydra_task(cfg: DictConfig) -> dict[str, Any]:
    """The job's error boundary inside Hydra's: Hydra's "Error executing job" and its traceback never show."""
    # a submitit job gets the command line's secrets as DS_EXP_SECRET_* (never its argv): blank them from here on
    register_secrets(environ=os.environ)
    try:
        return run_job(cfg)
    except Exception as err:
        status = report_error(err, log=job_log(), what="the run")
        if in_multirun():
            # the sweep's other jobs go on; the job's summary.json and the sweep report name the failure
            error = str(err) if isinstance(err, DsExpError) else f"{type(err).__name__}: {first_line(err)}"
            return {"status": getattr(err, "status", RunStatus.FAILED), "error": redact_text(error)}
        sys.exit(status)


class HydraTask:
    """hydra_task for Hydra's launchers: a submitit job unpickling it prepares its composition first (`task_in_job`)."""

    def __call__(self, cfg: DictConfig) -> dict[str, Any]:
        return hydra_task(cfg)

    def __reduce__(self) -> tuple[Callable[[], Callable[[DictConfig], dict[str, Any]]], tuple[()]]:
        return (task_in_job, ())


def task_in_job() -> Callable[[DictConfig], dict[str, Any]]:
    """The task, in a process that got it pickled (a submitit job), ready for the composition that comes next."""
    prepare_composition()
    return hydra_task


def prepare_composition() -> None:
    """What every composition needs in its process: resolvers, schema, hidden credentials, data-path checks."""
    register_resolvers()
    register_configs()
    check_list_items_when_composing()


def job_log() -> Path | None:
    """Hydra's log in the run directory: an unexpected error's traceback goes there when the run's own log lacks it."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    path = Path(hydra_cfg.runtime.output_dir) / f"{hydra_cfg.job.name}.log"
    return path if path.is_file() else None


@entry_point("ds_exp", exits=True)
def main() -> int:
    """`python -m ds_exp ...` inside the error boundary; a status other than 0 ends the process."""
    hold_library_logs()  # before anything imports DeepSpeed: what it says on import goes to the log file
    ours = PACKAGE_DIR.parent / "hydra_plugins"  # our sweepers: Hydra's scan misses an editable install's import hook
    if ours.is_dir() and str(ours) not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(str(ours))
    sys.argv = quote_one_value_lists(strip_local_rank(sys.argv))  # data.data_split=10,0,0 is one value, not a sweep
    register_secrets(environ=os.environ)
    if wants_experiment_file(sys.argv[1:]):  # before Hydra: the command line is saved, not run
        return write_experiment_main(sys.argv[1:])
    if wants_help(sys.argv[1:]):  # ds_exp's help from conf/'s comments (Hydra's own: --hydra-help)
        print_help(sys.argv[1:])
    sys.argv[1:] = prepare_overrides(sys.argv[1:])
    compat.raise_hydra_errors()  # a bad override is told by the boundary, as every other refusal
    with stop_before_start():  # a rank stopped by its launcher before its run starts leaves nothing, quietly
        hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(HydraTask())()
    return 0


def prepare_overrides(args: list[str]) -> list[str]:
    """What every way into a run does before Hydra reads its overrides (the command line, ds_exp.train's API)."""
    if problems := launch_env_problems():  # else the process would wait for ranks that never come
        raise ConfigError(problems)
    # before Hydra sees them: secret values move to DS_EXP_SECRET_* variables (see ds_exp/config/secrets.py)
    args = hide_secret_overrides(args, os.environ)
    check_config_files(args)  # the user's experiment files: one message each, before Hydra reads them
    args += rank_placeholder_overrides(args)
    prepare_composition()
    return args
