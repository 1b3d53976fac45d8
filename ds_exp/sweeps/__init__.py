"""Sweeps: jobs validated before launch, the sweep's callbacks and report, the listing of runs, the optuna sweeper.
Layer 5, light. May import: ds_exp.core, config, data, resume, launch (autotune needs the model stack: ds_exp.tools)."""
