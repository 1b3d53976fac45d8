"""study.png: optuna's slice plot of the objective against each searched parameter, redrawn after each batch of trials;
a picture that cannot be drawn is said once, never fails the study."""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from optuna.trial import TrialState

from ds_exp.core.errors import first_line
from ds_exp.core.files import write_bytes_atomic
from ds_exp.launch.run_logging import quiet_matplotlib
from ds_exp.sweeps.study_files import STUDY_PLOT

if TYPE_CHECKING:
    from optuna import Study


def plot_study(sweep_dir: Path, study: Study, objective: str) -> None:
    """<sweep dir>/study.png, once a trial has completed."""
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return  # nothing to show yet
    path = sweep_dir / STUDY_PLOT
    try:
        write_bytes_atomic(path, _slice_png(study, objective))
    except Exception as err:
        print(f"ds_exp: warning: {path} was not drawn ({first_line(err)}); study.json has every trial", file=sys.stderr)


def _slice_png(study: Study, objective: str) -> bytes:
    quiet_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # the sweeper's own process: nothing is shown, the picture is a file
    import matplotlib.pyplot as plt
    from matplotlib.collections import PathCollection
    from matplotlib.colors import ListedColormap
    from matplotlib.ticker import MaxNLocator, NullFormatter
    from optuna.visualization.matplotlib import plot_slice

    with warnings.catch_warnings(), plt.rc_context():  # plot_slice sets pyplot's ggplot style: not for later plots
        warnings.simplefilter("ignore")  # plot_slice is experimental; a study of one value per parameter warns
        drawn: Any = plot_slice(study, target_name=objective)
        axes = list(getattr(drawn, "flat", [drawn]))
        figure = axes[0].figure
        try:
            figure.set_size_inches(max(6.4, 4.2 * len(axes)), 4.8)
            title = f"optuna study {study.study_name}: {objective} against each searched parameter"
            figure.suptitle(title, fontsize=11)
            if len(axes) == 1:
                axes[0].set_title("")  # plot_slice's "Slice Plot": the title above says what it is
            # plot_slice colours trial 0 white (Blues' first colour) on ggplot's grey: Blues from its mid-light blue on
            trials = ListedColormap(matplotlib.colormaps["Blues"](np.linspace(0.4, 1.0, 256)))
            for points in (c for ax in figure.axes for c in ax.collections if isinstance(c, PathCollection)):
                points.set_cmap(trials)
                points.set_edgecolor("0.25")
            for colorbar in figure.axes[len(axes) :]:  # trial numbers, not 0.5 of a trial
                colorbar.yaxis.set_major_locator(MaxNLocator(integer=True))
            for ax in axes:
                ax.tick_params(axis="x", labelrotation=30)
                if ax.get_xscale() == "log":  # a log-scaled parameter (optimizer.lr): decades only, no crowding
                    ax.xaxis.set_minor_formatter(NullFormatter())
                elif any(t.get_text().startswith("'") for t in ax.get_xticklabels()):  # choices: as typed, unquoted
                    ax.set_xticks(ax.get_xticks(), [t.get_text().strip("'") for t in ax.get_xticklabels()])
            out = io.BytesIO()
            figure.savefig(out, format="png", dpi=100, bbox_inches="tight")
        finally:
            plt.close(figure)
    return out.getvalue()
