"""The Python API: `from ds_exp import train; summary = train(["zero=stage3", "lora.dim=64"])` runs what `python -m
ds_exp zero=stage3 lora.dim=64` does, in this process on one rank (gloo on the CPU, or the one GPU), one argument per
item (no shell quoting), and returns its summary.json (a dry run: its plan). Whatever ds_exp explains raises a
DsExpError whose str() is the command line's message; a bug is raised as it is; Ctrl-C saves a checkpoint, then raises
KeyboardInterrupt. A call leaves the process as it found it (engine, process group, Hydra's global state, logging
handlers, launch variables), so calls follow one another. Typed code imports `from ds_exp.train.api import train`."""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.utils import run_job as run_hydra_job
from hydra.errors import HydraException
from hydra.types import HydraContext, RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from ds_exp.config.override_checks import composition_problem, quote_one_value_lists
from ds_exp.config.paths import conf_dir
from ds_exp.config.secrets import redact_text, register_secrets
from ds_exp.core import compat
from ds_exp.core.errors import ConfigError, DsExpError, RunFailed, first_line
from ds_exp.launch import cli
from ds_exp.launch.console import full_error
from ds_exp.launch.environment import launched_with_several_ranks
from ds_exp.launch.lock import release_run_dir
from ds_exp.launch.run_dir import check_run_start, remove_refused_attempt
from ds_exp.launch.run_logging import hold_library_logs

# what a launch exports for torch.distributed's env:// rendezvous (ds_exp.launch.environment.export_launch_env)
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def train(overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Train (or plan, dry_run=true) one run of `overrides` in this process; its summary.json. See the module."""
    try:
        return _train(_arguments(overrides))
    except DsExpError as err:
        if full_error():
            raise
        # as the command line says it: its text with no secret, without the traceback and chain behind it
        err.args = tuple(redact_text(a) if isinstance(a, str) else a for a in err.args)
        if isinstance(err, ConfigError):
            err.problems = [redact_text(p) for p in err.problems]
        raise err.with_traceback(None) from None
    except (HydraException, OmegaConfBaseException) as err:  # a key or value Hydra refused while composing
        if full_error():
            raise
        raise ConfigError(redact_text(composition_problem(err))) from None


def _arguments(overrides: Sequence[str]) -> list[str]:
    if isinstance(overrides, str):
        raise ConfigError(f"train() takes a list of overrides, e.g. train([{overrides!r}]), not one string")
    if not isinstance(overrides, Iterable) or isinstance(overrides, Mapping | bytes):
        what = "None" if overrides is None else f"a {type(overrides).__name__}"
        raise ConfigError(f"train() takes a list of overrides, e.g. train(['train.max_steps=10']), not {what}")
    args = [str(item) for item in overrides]
    flags = [item for item in args if item.startswith("-")]
    if flags:
        raise ConfigError(
            f"train() takes overrides (key=value), not command-line flags: {' '.join(flags)}; a sweep (-m) or "
            "--config-dir runs with `python -m ds_exp`"
        )
    if launched_with_several_ranks():
        world = os.environ.get("WORLD_SIZE", "several")
        raise ConfigError(
            f"train() runs one rank in this process, and this one was launched as one of {world}: launch the ranks "
            "with `torchrun --nproc_per_node N -m ds_exp OVERRIDES` instead"
        )
    return args


def _train(args: list[str]) -> dict[str, Any]:
    hold_library_logs()  # before DeepSpeed is imported (the first run): its records go to the run's log file
    args = quote_one_value_lists(args)
    register_secrets(environ=os.environ)
    with _as_it_was():
        args = cli.prepare_overrides(args)
        with initialize_config_dir(config_dir=str(conf_dir()), job_name="ds_exp", version_base="1.3"):
            config = compose(config_name="config", overrides=args, return_hydra_config=True)
            config.hydra.mode = RunMode.RUN
            check_run_start(config)  # as Hydra's callback does for the command line (CheckRunDir), but raising
            outcome: dict[str, Any] = {}

            def task(composed: DictConfig) -> None:
                try:
                    outcome["value"] = cli.run_job(composed)
                except BaseException as err:  # raised once Hydra has finished the job (logs flushed, cwd back)
                    outcome["error"] = err

            loader = GlobalHydra.instance().config_loader()
            context = HydraContext(config_loader=loader, callbacks=compat.hydra_job_callbacks(config, _callback_failed))
            try:
                run_hydra_job(task, config, "hydra.run.dir", None, hydra_context=context)
            except RunFailed as err:  # a user's callback failed (the run's own error, if any, is the one told)
                if not outcome:  # at the job's start: refused before any work, so nothing of the attempt stays
                    run_dir = Path(str(config.hydra.runtime.output_dir))
                    remove_refused_attempt(run_dir, config.hydra.output_subdir, f"{config.hydra.job.name}.log")
                outcome.setdefault("error", err)
            finally:  # the run let it go (Session.finish), unless it was refused first: the command line's exit would
                release_run_dir(Path(str(config.hydra.run.dir)))
    if "error" in outcome:
        error = outcome["error"]
        if isinstance(error, SystemExit) and error.code == 128 + signal.SIGINT:  # Ctrl-C's exit 130 (runtime.signals)
            raise KeyboardInterrupt()  # as Python says it
        raise error
    if config.get("dry_run"):
        return dict(outcome["value"])  # the plan (plan.json)
    run_dir = Path(str(config.hydra.runtime.output_dir))  # absolute, the directory taken (hydra.run.dir)
    return dict(json.loads((run_dir / "summary.json").read_text()))


def _callback_failed(name: str, err: Exception) -> RunFailed:
    """A user's Hydra callback that raised fails the run with its message (Hydra alone would only warn)."""
    return RunFailed(f"the Hydra callback {name} failed: {type(err).__name__}: {first_line(err)}")


@contextmanager
def _as_it_was() -> Iterator[None]:
    """The process as it was before the run: no process group of the run's, the logging and launch variables."""
    # it imports DeepSpeed, which logs on import: here, once hold_library_logs keeps that for the run's log file
    from ds_exp.runtime.process_group import release_process_groups

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    launch = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    had_group = dist.is_initialized()
    try:
        yield
    finally:
        if not had_group:
            release_process_groups()
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()  # the run's ds_exp.log, Hydra's console
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)
        for name, value in launch.items():
            if value is None:
                os.environ.pop(name, None)
