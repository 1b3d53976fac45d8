"""Sweeps as Hydra runs them: each job composed and validated before launch (jobs), the sweep's Hydra callbacks
(callbacks), the sweep report (report, its picture report_plot; a column per lm-eval score it finds), the
listing of a tree of runs (runs), and the optuna study sweeper (optuna_study, search_space, study_files, study_plot).

Layer 5, light: no torch, no deepspeed (the sweep process never trains). May import: ds_exp.core,
ds_exp.config, ds_exp.data, ds_exp.resume, ds_exp.launch. The autotune sweeper needs the model stack to count
parameters and lives in ds_exp.tools.autotune.
"""
