"""A sweep's jobs, each composed and validated once before anything is launched (every sweeper comes here); a job
resuming in its directory continues its own config there, saved for it once every job passed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ds_exp.config.override_checks import composition_problem
from ds_exp.core import compat
from ds_exp.core.errors import DsExpError
from ds_exp.launch.run_config import continue_run_config, keep_job_config, resume_note, task_overrides
from ds_exp.launch.run_dir import check_job_dir
from ds_exp.launch.validation import validate_job
from ds_exp.sweeps.study_files import STUDY_FILE, is_study_sweep

if TYPE_CHECKING:
    from hydra.core.config_loader import ConfigLoader
    from hydra.plugins.launcher import Launcher

    from ds_exp.config.schema import Config


class LaunchingSweeper(Sweeper):
    """A sweeper whose jobs Hydra's configured launcher (hydra/launcher) starts."""

    hydra_context: HydraContext | None = None
    config: DictConfig | None = None
    launcher: Launcher | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )


def sweep_jobs(config: DictConfig) -> list[list[str]] | None:
    """Each job's overrides, as Hydra's basic sweeper will expand them; None for other sweepers."""
    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    given = config.hydra.sweeper.get("params")
    raw = OmegaConf.to_container(given, resolve=True) if given else {}
    assert isinstance(raw, dict)  # hydra.sweeper.params: a mapping (Hydra's schema)
    params = {str(key): value for key, value in raw.items()}
    overrides = [f"{key}={value}" for key, value in params.items()] + task_overrides(config)  # secrets unresolved
    return compat.basic_sweep_jobs(overrides)


def job_dir_of(composed: DictConfig) -> Path:
    """Where the launcher will run the job (Hydra's run_job: hydra.sweep.dir joined with hydra.sweep.subdir)."""
    return Path(str(composed.hydra.sweep.dir)) / str(composed.hydra.sweep.subdir)


# the job directories this process's sweep launches (check_job records them): the report lists only those
launched_job_dirs: list[Path] = []
# resumed jobs checked so far: job dir -> (config continued, the resume's note), saved once the whole sweep is valid
resumed_jobs: dict[Path, tuple[DictConfig, str]] = {}


def check_job(
    loader: ConfigLoader,
    config: DictConfig,
    overrides: list[str],
    num: int | None = None,
    *,
    continues: bool = False,
    composed: tuple[DictConfig, Config] | None = None,
) -> tuple[DictConfig | None, list[str]]:
    """One job composed, validated, its directory checked: (config, []) or (None, problems)."""
    try:
        cfg = composed[0] if composed is not None else loader.load_sweep_config(config, list(overrides))
        if num is not None:  # as the launcher will set it: hydra.sweep.subdir names the job's directory by it
            with read_write(cfg.hydra), open_dict(cfg.hydra):
                cfg.hydra.job.num = num
        note = _continue_job(cfg, overrides) if continues and num is not None else None
        typed = composed[1] if composed is not None else validate_job(cfg, overrides)
        if num is not None:
            job_dir = job_dir_of(cfg)
            runs_here = str(cfg.hydra.launcher.get("_target_", "")).endswith("BasicLauncher")
            check_job_dir(typed, job_dir, Path(str(cfg.hydra.sweep.dir)), runs_here=runs_here)
            launched_job_dirs.append(job_dir.absolute())
            if note is not None:
                resumed_jobs[job_dir.absolute()] = (cfg, note)
    except DsExpError as err:
        return None, [f"job [{' '.join(overrides)}]: {line}" for line in str(err).splitlines()]
    except HydraException as err:  # composition errors (unknown option, wrong type) from Hydra / OmegaConf
        return None, [f"job [{' '.join(overrides)}]: {composition_problem(err)}"]
    except Exception as err:
        return None, [f"job [{' '.join(overrides)}]: {err}".splitlines()[0]]
    return cfg, []


def _continue_job(cfg: DictConfig, overrides: list[str]) -> str | None:
    """A resuming job with a saved config continues it, its overrides as changes; the resume's note, or None."""
    if cfg.get("resume") is None:
        return None
    job_dir = job_dir_of(cfg)
    changed = continue_run_config(cfg, job_dir, list(overrides))
    return None if changed is None else resume_note(job_dir, changed, what=f"sweep job {job_dir}")


def forget_resumed_jobs() -> None:
    """A new sweep in this process (in-process tests run many): nothing of an earlier, refused one is kept."""
    resumed_jobs.clear()


def keep_resumed_configs() -> None:
    """Once every job is valid: save (and say) each resumed job's config for it (launch.run_config.keep_job_config)."""
    for job_dir, (cfg, note) in resumed_jobs.items():
        print(f"ds_exp: {note}", file=sys.stderr)
        keep_job_config(job_dir, cfg)
    resumed_jobs.clear()


def own_job_dirs(config: DictConfig, sweep_dir: Path) -> list[Path] | None:
    """This sweep's job directories: a study's trials, else what this process launched; None when neither is known."""
    if is_study_sweep(config) and (sweep_dir / STUDY_FILE).is_file():
        trials = json.loads((sweep_dir / STUDY_FILE).read_text())["trials"]
        return [Path(t["job_dir"]).absolute() for t in trials if t.get("job_dir") and Path(t["job_dir"]).is_dir()]
    return list(dict.fromkeys(launched_job_dirs)) or None
