"""An optuna study's record: how each trial ended (from its run's summary.json), study.json beside optuna.db, and
the study's part of the sweep report (ds_exp/sweeps/report.py). The sweeper itself is ds_exp/sweeps/optuna_study.py."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_exp.config.ds_config import override_key
from ds_exp.config.paths import sweep_job_names
from ds_exp.core.errors import ConfigError
from ds_exp.core.status import RunStatus

if TYPE_CHECKING:
    from omegaconf import DictConfig

# the probe session's own keys, never part of the configuration it recommends
SESSION_KEYS = ("resume", "dry_run", "hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")
STUDY_FILE = "study.json"
STUDY_PLOT = "study.png"  # the objective against each searched parameter (ds_exp/sweeps/study_plot.py)
# numbers a run's summary.json reports that a study may optimise (ds_exp/artifacts/summary.py)
EVAL_METRICS = ("eval_loss", "perplexity", "reward_accuracy", "reward_margin")  # the last two: objective=dpo, reward
RUN_METRICS = ("train_loss", "tokens_per_s", "tokens_per_s_per_device", "samples_per_s", "mfu", "wall_time_s")
OBJECTIVES = tuple(f"final_eval.{m}" for m in EVAL_METRICS) + RUN_METRICS
ABANDONED = "the sweep that ran it ended before it did"
# The settings that make a study what it is: a continued study must keep them.
IDENTITY = ("study_name", "storage", "objective", "direction", "search_space", "fixed")


def is_study_sweep(config: DictConfig) -> bool:
    return str(config.hydra.sweeper.get("_target_", "")).endswith(".OptunaSweeper")


def outcome(
    job_dir: Path, objective: str, launch_error: str | None
) -> tuple[str, float | None, str | None, dict[str, Any] | None]:
    """(state, value, error, summary) of a launched trial, from its run's summary.json."""
    summary_file = job_dir / "summary.json"
    if not summary_file.is_file():
        why = f"; the launcher reported {launch_error}" if launch_error else ""
        return "FAIL", None, f"{summary_file} missing: the run never reached training or was killed{why}", None
    summary = json.loads(summary_file.read_text())
    status, error = summary.get("status"), summary.get("error")
    if status == RunStatus.DIVERGED or (
        status == RunStatus.FAILED and str(error).startswith("Diverged:")
    ):  # or an older run's
        return "PRUNED", None, error, summary
    if status != RunStatus.COMPLETED:
        return "FAIL", None, f"status {status}: {error}", summary
    value = metric(summary, objective)
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "MISSING", None, None, summary
    if not math.isfinite(value):
        return "PRUNED", None, f"{objective} is {value}: the run diverged", summary
    return "COMPLETE", float(value), None, summary


def metric(summary: dict[str, Any], path: str) -> Any:
    value: Any = summary
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def numbers_in(summary: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted names of the numbers a summary.json holds (for the message when the objective is not one)."""
    names = []
    for key, value in summary.items():
        if isinstance(value, dict):
            names += numbers_in(value, f"{prefix}{key}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            names.append(f"{prefix}{key}")
    return names


def check_study_dir(sweep_dir: Path, identity: dict[str, Any]) -> None:
    """A study continues only in its own directory, with the settings it was started with."""
    record = sweep_dir / STUDY_FILE
    if not record.is_file():
        jobs = sweep_job_names(sweep_dir)
        if jobs:
            raise ConfigError(
                f"hydra.sweep.dir={sweep_dir} already holds the jobs of a sweep that is no optuna study "
                f"({', '.join(jobs[:5])}); nothing was changed. Leave hydra.sweep.dir unset (outputs/optuna/"
                "<study_name>) or give a new one"
            )
        return
    earlier = json.loads(record.read_text())
    changed = [key for key in IDENTITY if earlier.get(key) != identity[key]]
    if changed:
        raise ConfigError(
            [
                f"hydra.sweep.dir={sweep_dir} holds optuna study {earlier.get('study_name')}, started with other "
                "settings (nothing was changed):",
                *(line for key in changed for line in setting_change(key, earlier.get(key), identity[key])),
                "Continue it with the settings it has (n_trials and the launcher may change), or start another "
                f"study: leave hydra.sweeper.study_name unset (each search is a study of its own) or name one, "
                f"e.g. hydra.sweeper.study_name={earlier.get('study_name')}-2",
            ]
        )


def setting_change(key: str, was: Any, now: Any) -> list[str]:
    """What changed in one setting of a study, as the command line writes it."""
    if key == "fixed":  # the overrides every trial gets, by key
        then = {override_key(o): o for o in was or [] if o not in (now or [])}
        later = {override_key(o): o for o in now or [] if o not in (was or [])}
        lines = [f"every trial got {then.get(k, f'no {k}')}, now {later.get(k, f'no {k}')}" for k in {**then, **later}]
        return lines or [f"the overrides every trial gets are in another order (was: {' '.join(was or [])})"]
    if key == "search_space":
        searched_then, searched_now = dict(was or {}), dict(now or {})
        return [
            f"search of {name}: was {search_expression(searched_then.get(name))}, now "
            f"{search_expression(searched_now.get(name))}"
            for name in dict.fromkeys([*searched_then, *searched_now])
            if searched_then.get(name) != searched_now.get(name)
        ]
    return [f"{key}: was {was}, now {now}"]


def search_expression(distribution: str | None) -> str:
    """An optuna distribution as serialised in study.json, written as the search expression that makes it."""
    if distribution is None:
        return "not searched"
    try:
        spec = json.loads(distribution)
        name, attrs = spec["name"], spec["attributes"]
    except (ValueError, KeyError, TypeError):
        return str(distribution)
    if name == "CategoricalDistribution":
        return f"choice({','.join(str(c) for c in attrs['choices'])})"
    tags = [tag for tag, on in (("int", name == "IntDistribution"), ("log", attrs.get("log"))) if on]
    if name == "IntDistribution" and attrs.get("step", 1) != 1:
        return f"range({attrs['low']},{attrs['high'] + attrs['step']},{attrs['step']})"
    interval = f"interval({attrs['low']:g},{attrs['high']:g})"
    return f"tag({','.join(tags)},{interval})" if tags else interval


def shown_storage(storage: str) -> str:
    """A storage URL without its password (it reaches study.json, the report and messages)."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", storage)


def command_line(overrides: list[str], world_size: int | None) -> str:
    """The command that trains a trial's config again as a single run (without the study session's own keys)."""
    overrides = [o for o in overrides if override_key(o) not in SESSION_KEYS]
    launcher = ["python", "-m", "ds_exp"]
    if world_size and world_size > 1:
        launcher = ["torchrun", f"--nproc_per_node={world_size}", "-m", "ds_exp"]
    return " ".join(launcher + [shlex.quote(item) for item in overrides])


def study_section(sweep_dir: Path) -> str | None:
    """An optuna study's part of the report (None for other sweeps): every trial, the best with its command."""
    record = sweep_dir / STUDY_FILE
    if not record.is_file():
        return None
    study = json.loads(record.read_text())
    trials = study["trials"]
    counts = {state: sum(t["state"] == state for t in trials) for state in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")}
    lines = [
        f"## Optuna study {study['study_name']}",
        "",
        f"Objective {study['objective']} ({study['direction']}); {len(trials)} trials of n_trials={study['n_trials']}: "
        + ", ".join(f"{n} {state.lower()}" for state, n in counts.items() if n)
        + f"; storage {study['storage']}",
        "",
        "| trial | state | value | params | error |",
        "|---|---|---|---|---|",
    ]
    for t in trials:
        params = " ".join(f"{k}={_short(v)}" for k, v in (t["params"] or {}).items())
        error = (t["error"] or "").replace("|", "\\|").replace("\n", " ")[:200]
        value = "" if t["value"] is None else f"{t['value']:.6g}"
        lines.append(f"| {t['number']} | {t['state']} | {value} | {params} | {error} |")
    best = study.get("best")
    lines.append("")
    if (sweep_dir / STUDY_PLOT).is_file():
        lines += [f"![the objective against each searched parameter]({STUDY_PLOT})", ""]
    if best is None:
        lines.append("Best trial: none yet (no trial completed).")
    else:
        params = " ".join(f"{k}={v!r}" for k, v in best["params"].items())
        lines += [
            f"Best trial: {best['number']}, {study['objective']}={best['value']:.6g} with {params} "
            f"(run directory {best['job_dir']}). Train it again with:",
            "",
            f"    {best['command']}",
        ]
    return "\n".join(lines) + "\n"


def study_values(sweep_dir: Path) -> tuple[str, str, dict[str, float | None]] | None:
    """A study's objective, direction and each trial's value by job directory (None for other sweeps)."""
    record = sweep_dir / STUDY_FILE
    if not record.is_file():
        return None
    study = json.loads(record.read_text())
    values = {Path(t["job_dir"]).name: t["value"] for t in study["trials"] if t.get("job_dir")}
    return str(study["objective"]), str(study["direction"]), values


def _short(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def completed_trials(sweep_dir: Path) -> int:
    return sum(t["state"] == "COMPLETE" for t in json.loads((sweep_dir / STUDY_FILE).read_text())["trials"])
