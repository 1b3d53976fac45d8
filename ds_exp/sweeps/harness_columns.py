"""The sweep report's columns of lm-eval scores: one per task metric a job's summary.json holds (eval.harness,
ds_exp/train/harness.py), `harness.<task>.<metric>` (the tuned model's value; the name an optuna study's objective
gives it), after the fixed columns of ds_exp/sweeps/report.py."""

from __future__ import annotations

from typing import Any

PREFIX = "harness"
PREFERENCE = ("reward_accuracy", "reward_margin")  # final_eval of objective=dpo / reward (ds_exp/preference/)


def harness_cells(summary: dict[str, Any]) -> dict[str, Any]:
    """{harness.<task>.<metric>: value} of one job's summary.json."""
    scores = summary.get(PREFIX) or {}
    return {f"{PREFIX}.{task}.{metric}": value for task, metrics in scores.items() for metric, value in metrics.items()}


def harness_damaged(summary: dict[str, Any]) -> bool:
    """summary.json's `harness` is not what a run writes there (task -> metric -> number or null)."""
    scores = summary.get(PREFIX)
    if scores is None:
        return False
    if not isinstance(scores, dict) or not all(isinstance(m, dict) for m in scores.values()):
        return True
    values = [v for metrics in scores.values() for v in metrics.values()]
    return not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values)


def report_columns(fixed: list[str], rows: list[dict[str, Any]]) -> list[str]:
    """The fixed columns, then preference tuning's and every harness column a row has (sorted), before the error
    columns at the end."""
    found = [name for name in PREFERENCE if any(name in row for row in rows)]
    found += sorted({key for row in rows for key in row if key.startswith(f"{PREFIX}.")})
    if not found:
        return fixed
    at = fixed.index("wall_time_s")
    return [*fixed[:at], *found, *fixed[at:]]
