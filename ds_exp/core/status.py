"""How a run ended: the `status` of summary.json, the sweep report, the trackers and a sweep's decisions."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """A str: equal to its value, and written to JSON as it (summary.json files of older runs read the same)."""

    COMPLETED = "completed"
    FAILED = "failed"
    DIVERGED = "diverged"  # a loss or weights not finite: a failed run, said as such (exit 3)
    STOPPED = "stopped"  # a stop signal: the run saved a checkpoint and can be resumed
    REQUEUED = "requeued"  # stopped under SLURM/submitit, which queues it again
    INTERRUPTED = "interrupted"  # Ctrl-C
    UNCHANGED = "unchanged"  # the run directory holds a finished run already: nothing was written


RESUMABLE_ENDS = (RunStatus.COMPLETED, RunStatus.STOPPED, RunStatus.REQUEUED)  # a checkpoint at the end
CONTINUABLE = (RunStatus.STOPPED, RunStatus.INTERRUPTED, RunStatus.REQUEUED)  # a sweep continues them
