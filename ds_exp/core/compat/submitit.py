"""submitit's internals ds_exp relies on (1.5.4): the signal before a time limit or a preemption."""

from __future__ import annotations


def submitit_requeue_signal() -> int:
    """The signal SLURM sends before a time limit or a preemption, as submitit expects it (test_slurm.py)."""
    import submitit

    return int(submitit.JobEnvironment._usr_sig())
