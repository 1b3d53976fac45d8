"""`hydra/sweeper=optuna`: a thin sweeper over optuna's ask/tell (hydra-optuna-sweeper pins optuna < 3). Each trial is
one job validated here; diverged runs are PRUNED, failures FAIL. The same command continues the study (optuna.db)."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from ds_exp.config.ds_config import IgnoredOverride
from ds_exp.config.features import feature_settings, objective_problems
from ds_exp.config.schema import to_config
from ds_exp.config.secrets import redact_text
from ds_exp.core.compat import optuna_trial_of
from ds_exp.core.errors import ConfigError, DsExpError, first_line
from ds_exp.core.files import write_json_atomic
from ds_exp.core.status import CONTINUABLE, RunStatus
from ds_exp.core.waits import announced
from ds_exp.launch.console import report_user_error
from ds_exp.launch.lock import live_holder
from ds_exp.launch.run_dir import read_summary
from ds_exp.launch.validation import validate_job
from ds_exp.sweeps.jobs import LaunchingSweeper, check_job, job_dir_of
from ds_exp.sweeps.search_space import SearchSpace, parse_search_space, probe_overrides
from ds_exp.sweeps.study_files import (
    ABANDONED,
    OBJECTIVES,
    STUDY_FILE,
    check_study_dir,
    command_line,
    numbers_in,
    outcome,
    shown_storage,
)
from ds_exp.sweeps.study_plot import plot_study

if TYPE_CHECKING:
    from collections.abc import Callable

    from optuna import Study
    from optuna.samplers import BaseSampler
    from optuna.trial import FrozenTrial, Trial

log = logging.getLogger(__name__)

DB_FILE = "optuna.db"


# Drivers whose package is not named as the module SQLAlchemy imports
_DRIVER_PACKAGES = {"MySQLdb": "mysqlclient", "psycopg2": "psycopg2-binary", "psycopg": "psycopg[binary]"}


def check_storage(storage: str) -> None:
    """hydra.sweeper.storage is a URL SQLAlchemy can open with an installed driver."""
    shown = f"hydra.sweeper.storage={shown_storage(storage)}"
    unset = "or leave hydra.sweeper.storage unset for a SQLite file in the sweep directory"
    try:
        dialect = make_url(storage).get_dialect()
    except NoSuchModuleError:  # (an ArgumentError too)
        scheme = storage.split(":", 1)[0]
        raise ConfigError(
            f"{shown}: SQLAlchemy knows no database {scheme!r} (optuna keeps studies in SQL databases): give a "
            f"sqlite, mysql or postgresql URL, {unset}"
        ) from None
    except ArgumentError:
        raise ConfigError(
            f"{shown}: not a database URL; give one (e.g. sqlite:////path/study.db or "
            f"mysql+pymysql://user:PASSWORD@host/db), {unset}"
        ) from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        module = getattr(err, "name", None) or str(err)
        package = _DRIVER_PACKAGES.get(module.split(".")[0], module.split(".")[0])
        raise ConfigError(
            f"{shown}: the {dialect.name} driver {dialect.driver} is not installed (no module {module!r}); "
            f"pip install {package}, name an installed driver in the URL ({dialect.name}+<driver>://...), {unset}"
        ) from None


class StudySweeper(LaunchingSweeper):
    """The optuna sweeper; Hydra finds it as hydra_plugins.ds_exp_optuna.optuna_sweeper.OptunaSweeper."""

    def __init__(
        self,
        objective: str = "final_eval.eval_loss",
        direction: str = "minimize",
        study_name: str | None = None,
        storage: str | None = None,
        n_trials: int = 20,
        n_jobs: int = 1,
        sampler: Any = None,  # a Hydra instantiate config (YAML), built by make_sampler
        params: DictConfig | dict[str, object] | None = None,
        sweep_dir: str | None = None,  # read by conf/config.yaml's hydra.sweep.dir, not here
    ) -> None:
        super().__init__()
        self.objective, self.direction, self.study_name = objective, direction, study_name
        self.storage, self.n_trials, self.n_jobs = storage, n_trials, n_jobs
        self.sampler_cfg = sampler
        given = OmegaConf.to_container(params, resolve=True) if OmegaConf.is_config(params) else params or {}
        assert isinstance(given, dict)  # hydra.sweeper.params: a mapping (Hydra's schema)
        self.params = {str(key): value for key, value in given.items()}
        self.exhausted = False  # set when the sampler stops the study (its whole space tried)

    def sweep(self, arguments: list[str]) -> list[list[Trial]]:
        try:
            return self.run_study(arguments)
        except DsExpError as err:
            report_user_error(err)
            raise SystemExit(err.exit_code) from None

    def run_study(self, arguments: list[str]) -> list[list[Trial]]:
        assert self.config is not None and self.hydra_context is not None
        self.check_settings()
        loader = self.hydra_context.config_loader
        space = parse_search_space([f"{k}={v}" for k, v in self.params.items()] + list(arguments), loader)
        if not space.distributions:
            raise ConfigError(
                "hydra/sweeper=optuna needs a search space: e.g. 'optimizer.lr=tag(log,interval(1e-5,1e-3))' "
                "'zero=stage2,stage3' on the command line, or hydra.sweeper.params"
            )
        self.check_composes(space)
        if self.objective not in OBJECTIVES:  # a feature's number (harness.<task>.<metric>): the trials must report it
            found = feature_settings(to_config(self.config))
            problems = objective_problems(found, self.objective, key="hydra.sweeper.objective")
            if problems:
                raise ConfigError(problems)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        storage = self.storage or f"sqlite:///{sweep_dir.resolve() / DB_FILE}"
        check_storage(storage)  # before the sweep directory is made: a missing driver is a message, not a traceback
        identity = {
            "study_name": self.study_name,
            "storage": shown_storage(storage),
            "objective": self.objective,
            "direction": self.direction,
            "search_space": space.as_json(),
            "fixed": space.fixed,
        }
        check_study_dir(sweep_dir, identity)
        sweep_dir.mkdir(parents=True, exist_ok=True)  # one sweep at a time in it: ds_exp.launch.run_dir.lock_sweep_dir
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweeper says what happens, once
        # a database server (mysql://, postgresql://): said while its driver connects (its timeout bounds it)
        server = make_url(storage).host is not None
        shown = f"the study's database {shown_storage(storage)}"
        waiting = announced(shown, bound="its driver's connect timeout") if server else contextlib.nullcontext()
        try:
            with waiting:
                study = optuna.create_study(
                    storage=storage,
                    study_name=self.study_name,
                    direction="maximize" if self.direction == "maximize" else "minimize",
                    load_if_exists=True,
                )
        except Exception as err:  # the database: unreachable, refused, ... (SQLAlchemy's errors)
            if not type(err).__module__.startswith("sqlalchemy"):
                raise
            first = first_line(err)
            raise ConfigError(
                f"hydra.sweeper.storage={shown_storage(storage)}: the study's database cannot be opened ({first}); "
                "check the URL and that the database server runs, or leave hydra.sweeper.storage unset for a "
                "SQLite file in the sweep directory"
            ) from None
        if study.direction.name.lower() != self.direction:
            raise ConfigError(
                f"hydra.sweeper.direction={self.direction}: study {self.study_name} in {shown_storage(storage)} "
                f"was created to {study.direction.name.lower()}; keep its direction or name a new study"
            )
        sampler = self.make_sampler(len(study.trials))
        if sampler is not None:  # sampler=null: the study keeps optuna's default (create_study's TPESampler)
            study.sampler = sampler
        saved = sweep_dir / "multirun.yaml"  # as Hydra's basic sweeper writes it; a continued study keeps the first
        if saved.exists():
            saved = sweep_dir / f"multirun-{time.strftime('%Y-%m-%d_%H-%M-%S')}.yaml"
        OmegaConf.save(self.config, saved)
        returns = []
        continued = self.settle_abandoned(study, sweep_dir)
        write_study(sweep_dir, study, identity, self.n_trials)
        if continued:
            returns.append(continued)
        done = finished(study)
        print(
            f"ds_exp: optuna study {self.study_name} in {sweep_dir}: {done} of {self.n_trials} trials finished"
            f"{'' if done < self.n_trials else ', nothing to run (raise hydra.sweeper.n_trials to continue it)'}; "
            f"objective {self.objective} ({self.direction})"
        )
        while (done := finished(study)) < self.n_trials and not self.exhausted:
            trials = [study.ask(dict(space.distributions)) for _ in range(min(self.n_jobs, self.n_trials - done))]
            missing = self.run_trials(study, trials, space.overrides, sweep_dir)
            write_study(sweep_dir, study, identity, self.n_trials)
            if missing:
                raise ConfigError(missing)
            returns.append(trials)
        if self.exhausted:
            print(f"ds_exp: the sampler has tried its whole search space: the study stops at {finished(study)} trials")
        return returns

    def check_settings(self) -> None:
        problems = []
        if self.objective not in OBJECTIVES and not self.objective.startswith("harness."):
            problems.append(
                f"hydra.sweeper.objective={self.objective}: no run's summary.json reports it; choose one of "
                f"{', '.join(OBJECTIVES)}, or harness.<task>.<metric> (an eval.harness.tasks score)"
            )
        if self.direction not in ("minimize", "maximize"):
            problems.append(f"hydra.sweeper.direction={self.direction}: must be minimize or maximize")
        for key in ("n_trials", "n_jobs"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                problems.append(f"hydra.sweeper.{key}={getattr(self, key)}: must be a whole number >= 1")
        if not self.study_name:
            problems.append("hydra.sweeper.study_name is empty: name the study (it names its directory too)")
        if problems:
            raise ConfigError(problems)

    def check_composes(self, space: SearchSpace) -> None:
        """Compose the space's corners first: an unknown key or a searched key the runs ignore stops the study."""
        problems = []
        for overrides in probe_overrides(space):
            try:
                validate_job(self.compose(overrides), overrides)
            except IgnoredOverride as err:
                problems += [f"hydra/sweeper=optuna: {line}" for line in err.problems]
            except DsExpError:
                pass  # that corner's trial fails with its message; the rest of the space may be fine
            except Exception as err:  # Hydra's / OmegaConf's composition errors
                problems.append(
                    f"hydra/sweeper=optuna: a trial with [{' '.join(overrides)}] cannot be composed: " + first_line(err)
                )
        if problems:
            raise ConfigError(list(dict.fromkeys(problems)))

    def compose(self, overrides: list[str]) -> DictConfig:
        assert self.hydra_context is not None and self.config is not None
        return self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))

    def make_sampler(self, trials_so_far: int) -> BaseSampler | None:
        """The configured sampler, seeded with seed + the trials so far so a continued study draws new values."""
        if not self.sampler_cfg:
            return None
        sampler_cfg = self.sampler_cfg
        if OmegaConf.is_config(sampler_cfg):
            sampler_cfg = OmegaConf.to_container(sampler_cfg, resolve=True)
        sampler_cfg = dict(sampler_cfg)
        if sampler_cfg.get("seed") is not None:
            sampler_cfg["seed"] = int(sampler_cfg["seed"]) + trials_so_far
        try:
            return instantiate(sampler_cfg)
        except Exception as err:
            raise ConfigError(f"hydra.sweeper.sampler: {first_line(err)}") from None

    def settle_abandoned(self, study: optuna.Study, sweep_dir: Path) -> list[Trial]:
        """Trials an earlier run left RUNNING: a stopped one goes on, a completed one is recorded, the rest failed."""
        continued = []
        for frozen, what in abandoned_trials(study, sweep_dir):
            trial = optuna_trial_of(study, frozen)
            if what == "live":  # the sweep ended, its job did not (a SLURM job): a later run of the study tells it
                print(f"ds_exp: trial {trial.number} is still running elsewhere ({frozen.user_attrs['job_dir']})")
            elif what == "fail":
                self.tell(study, trial, TrialState.FAIL, None, ABANDONED)
            elif what == "tell":
                state, value, error, _ = outcome(Path(frozen.user_attrs["job_dir"]), self.objective, None)
                self.tell(study, trial, getattr(TrialState, "FAIL" if state == "MISSING" else state), value, error)
            else:
                print(f"ds_exp: trial {trial.number} was stopped before it finished: continuing it from its checkpoint")
                continued.append(trial)
        for start in range(0, len(continued), self.n_jobs):
            missing = self.run_trials(study, continued[start : start + self.n_jobs], None, sweep_dir, resume=True)
            if missing:
                raise ConfigError(missing)
        return continued

    def run_trials(
        self,
        study: optuna.Study,
        trials: list[Trial],
        overrides_of: Callable[[dict[str, Any]], list[str]] | None,
        sweep_dir: Path,
        *,
        resume: bool = False,
    ) -> list[str]:
        """Validate, launch and tell each trial; the problems that stop the study. `resume`: trials continued."""
        assert self.hydra_context is not None and self.config is not None
        launch: list[tuple[Trial, list[str], Path]] = []
        for trial in trials:
            if resume:
                overrides = [*trial.user_attrs["overrides"], "resume=auto"]
            else:
                assert overrides_of is not None  # a new trial: its values -> overrides
                overrides = overrides_of(trial.params)
                trial.set_user_attr("overrides", overrides)
                trial.set_user_attr("sweep_dir", str(sweep_dir))
            # validated once, as the basic sweeper's jobs (floats written exactly: every rank composes the same)
            cfg, problems = check_job(self.hydra_context.config_loader, self.config, overrides, trial.number)
            error = f"invalid trial, not launched: {'; '.join(problems)}" if problems else None
            if cfg is not None:
                job_dir = job_dir_of(cfg)
                trial.set_user_attr("job_dir", str(job_dir))
            if error is not None:
                self.tell(study, trial, TrialState.FAIL, None, redact_text(error))
            else:
                launch.append((trial, overrides, job_dir))
        launch_error = self.launch(launch)
        missing = []
        for trial, _, job_dir in launch:
            state, value, error, summary = outcome(job_dir, self.objective, launch_error)
            if summary is not None:
                trial.set_user_attr("world_size", summary.get("world_size"))
            if state == "MISSING":
                reported = ", ".join(numbers_in(summary or {})) or "none"
                missing.append(
                    f"hydra.sweeper.objective={self.objective}: trial {trial.number}'s run completed but its "
                    f"summary.json ({job_dir}) has no value for it, so no run will; numbers it reports: {reported}"
                )
                state, error = "FAIL", missing[-1]
            self.tell(study, trial, getattr(TrialState, state), value, error)
        return missing

    def launch(self, batch: list[tuple[Trial, list[str], Path]]) -> str | None:
        """Launch the batch (its job numbers are its trial numbers); the launcher's own error, if it raised."""
        groups: list[list[tuple[Trial, list[str], Path]]] = []
        for item in batch:  # trial numbers in a batch are consecutive unless another process asked in between
            if groups and groups[-1][-1][0].number + 1 == item[0].number:
                groups[-1].append(item)
            else:
                groups.append([item])
        error = None
        for group in groups:
            assert self.launcher is not None  # setup()
            try:
                self.launcher.launch([overrides for _, overrides, _ in group], initial_job_idx=group[0][0].number)
            except Exception as err:  # e.g. submitit: a job whose process died; its summary.json tells the rest
                error = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
                log.warning("the launcher reported: %s", error)
        return error

    def tell(
        self, study: optuna.Study, trial: Trial, state: TrialState, value: float | None, error: str | None
    ) -> None:
        if error is not None:
            trial.set_user_attr("error", error[:2000])
        try:
            study.tell(trial, value if state.name == "COMPLETE" else None, state=state)
        except RuntimeError as err:  # a grid / brute-force sampler that has covered its space calls study.stop()
            if "Study.stop" not in str(err):
                raise
            self.exhausted = True  # the trial was stored all the same (optuna stores it in a `finally`)
        reason = next((line[:300] for line in (error or "").splitlines() if line.strip()), "no value")
        shown = f"{self.objective}={value:.6g}" if value is not None else reason
        print(f"ds_exp: trial {trial.number} {state.name.lower()}: {shown}")


def write_study(sweep_dir: Path, study: Study, identity: dict[str, Any], n_trials: int) -> None:
    """study.json: the study's settings and every trial, for the sweep report (study_section); study.png beside."""
    trials: list[dict[str, Any]] = []
    for trial in study.get_trials(deepcopy=False):
        attrs = trial.user_attrs
        trials.append(
            {
                "number": trial.number,
                "state": trial.state.name,
                "value": trial.value,
                "params": trial.params,
                "overrides": attrs.get("overrides"),
                "job_dir": attrs.get("job_dir"),
                "world_size": attrs.get("world_size"),
                "error": attrs.get("error") or (ABANDONED if trial.state == TrialState.FAIL else None),
            }
        )
    best = None
    if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        best = next(t for t in trials if t["number"] == study.best_trial.number)
        best = {**best, "command": command_line(best["overrides"] or [], best["world_size"])}
    write_json_atomic(sweep_dir / STUDY_FILE, {**identity, "n_trials": n_trials, "trials": trials, "best": best})
    plot_study(sweep_dir, study, identity["objective"])


def finished(study: Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))


def abandoned_trials(study: Study, sweep_dir: Path) -> list[tuple[FrozenTrial, str]]:
    """This directory's RUNNING trials, each with what a re-run does: "continue", "tell", "live" or "fail"."""
    found = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if trial.user_attrs.get("sweep_dir") != str(sweep_dir):
            continue
        job_dir = trial.user_attrs.get("job_dir")
        summary = read_summary(Path(job_dir)) if job_dir else None
        status = (summary or {}).get("status")
        if job_dir and live_holder(Path(job_dir)) is not None:
            found.append((trial, "live"))
        elif status in CONTINUABLE and trial.user_attrs.get("overrides") is not None:
            found.append((trial, "continue"))
        elif status in (RunStatus.COMPLETED, RunStatus.FAILED):
            found.append((trial, "tell"))
        else:
            found.append((trial, "fail"))
    return found
