"""optuna's internals ds_exp relies on (5.0.0): a live trial for a RUNNING one an earlier process asked for."""

from __future__ import annotations

from typing import Any


def optuna_trial_of(study: Any, frozen: Any) -> Any:
    """A live `optuna.trial.Trial` for a RUNNING trial an earlier process asked for (the study's get_trials gives
    FrozenTrials, whose set_user_attr does not reach the storage and which study.tell does not accept), so that the
    trial can be continued and told like one asked for now.

    optuna 5.0.0: `Trial(study, trial_id)` is public, but a FrozenTrial's id is only its private `_trial_id`. If it
    goes, a study re-run cannot continue its stopped trials (tests/system/test_optuna.py catches it)."""
    from optuna.trial import Trial

    return Trial(study, frozen._trial_id)
