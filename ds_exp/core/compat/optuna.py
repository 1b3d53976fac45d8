"""optuna's internals ds_exp relies on (5.0.0): a live trial for a RUNNING one an earlier process asked for."""

from __future__ import annotations

from typing import Any


def optuna_trial_of(study: Any, frozen: Any) -> Any:
    """A live `optuna.trial.Trial` for a RUNNING trial an earlier process asked for, so it can be continued and told
    (a FrozenTrial cannot be); its id is private (tests/system/test_optuna.py)."""
    from optuna.trial import Trial

    return Trial(study, frozen._trial_id)
