"""Tools around runs, each an entry point: dry_run, autotune, parity, torchrun. Layer 11, heavy. May import every layer
below it."""
