"""submitit's internals ds_exp relies on (1.5.4): the signal before a time limit or a preemption."""

from __future__ import annotations


def submitit_requeue_signal() -> int:
    """The signal SLURM sends before a time limit or a preemption, as submitit's job expects it.

    submitit 1.5.4: `JobEnvironment._usr_sig()` (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise). If it
    moves, the requeue test (tests/system/test_slurm.py) fails."""
    import submitit

    return int(submitit.JobEnvironment._usr_sig())
