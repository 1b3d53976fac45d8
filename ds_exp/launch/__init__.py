"""Starting a process, before anything heavy: the command line and its Hydra entry (cli), how the process was
launched (environment), everything checked before heavy work (validation), the
run directory's guards and its lock (run_dir, lock, callbacks: the single run's Hydra callback), per-rank log
files (run_logging), every command's error boundary (console), files written whole (files) and disk checks
(storage).

Layer 4, light: no torch, no deepspeed. May import: ds_exp.core, ds_exp.config, ds_exp.data,
ds_exp.resume. The one exception is cli.run_job, which imports the training stack (ds_exp.train.recipe,
ds_exp.tools.dry_run) once validation has passed.
"""
