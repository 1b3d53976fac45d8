"""Hydra instantiates sweepers only from the `hydra_plugins` namespace: this names ds_exp's autotuning sweeper
there (`hydra/sweeper=autotune`, conf/hydra/sweeper/autotune.yaml). The code is in ds_exp/autotune.py."""

from __future__ import annotations

from ds_exp.tools.autotune import Autotune


class AutotuneSweeper(Autotune):
    """ds_exp/autotune.py's sweeper, under the name Hydra accepts."""
