"""ds_exp's optuna sweeper, where Hydra looks for plugins (it instantiates only classes under hydra_plugins.*).

The sweeper itself is ds_exp/study.py; this module stays light (Hydra imports it on every start).
"""

from ds_exp.sweeps.optuna_study import StudySweeper


class OptunaSweeper(StudySweeper):
    """`hydra/sweeper=optuna` (conf/hydra/sweeper/optuna.yaml)."""
