"""Tools around runs, each an entry point: the dry run's plan (dry_run), the autotune sweeper (autotune), the parity
check of two configurations (parity), torchrun as launchers/torchrun.sh runs it (torchrun). Layer 11, heavy. May import
every layer below it."""
