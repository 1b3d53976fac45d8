"""Sweeps as Hydra runs them: each job validated before launch (jobs), the sweep's callbacks, its report (report,
report_plot), the listing of runs (runs) and the optuna sweeper (optuna_study, search_space, study_files, study_plot).
Layer 5, light: no torch, no deepspeed. May import: ds_exp.core, ds_exp.config, ds_exp.data, ds_exp.resume,
ds_exp.launch. The autotune sweeper needs the model stack: ds_exp.tools.autotune."""
