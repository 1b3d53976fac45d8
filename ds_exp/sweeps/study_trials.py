"""An optuna study's trials across sessions: the ones an earlier session left RUNNING (continued or failed),
how many finished, and study.json (with its picture, study.png) written for people."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from optuna.trial import TrialState

from ds_exp.core.files import write_json_atomic
from ds_exp.core.status import CONTINUABLE, RunStatus
from ds_exp.launch.lock import live_holder
from ds_exp.launch.run_dir import read_summary
from ds_exp.sweeps.study_files import ABANDONED, STUDY_FILE, command_line
from ds_exp.sweeps.study_plot import plot_study

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial


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


# How a trial's run ended that a sweep stopping before it did (Ctrl-C, a lost login node) leaves continuable: it
# saved a checkpoint (or had not reached one) and said how to go on.


def finished(study: Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))


def abandoned_trials(study: Study, sweep_dir: Path) -> list[tuple[FrozenTrial, str]]:
    """Trials of this directory still RUNNING: they belong to a sweep that ended before they did. Each with what
    the re-run does with it: "continue" (its run was stopped or interrupted: the same trial goes on from its
    checkpoint, resume=auto in its own directory), "tell" (its run completed after all, e.g. continued by hand:
    recorded as it ended), "live" (its run still holds its directory's lock, e.g. a SLURM job that outlived the
    sweep: left RUNNING) or "fail" (killed: recorded as failed, its directory left as it is)."""
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
