"""Tools around runs, each an entry point: the dry run's plan without weights (dry_run), the autotune sweeper
(autotune: which configuration fits and which is fastest), the parity check of two configurations (parity),
and torchrun as launchers/torchrun.sh runs it (torchrun: a failed launch ends on the failed rank's own line).

Layer 11, heavy. May import every layer below it.
"""
