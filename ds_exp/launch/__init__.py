"""Starting a process, before anything heavy: the command line (cli), how it was launched (environment), the checks
before heavy work (validation), the run directory's guards and lock (run_dir, lock, callbacks), per-rank logs
(run_logging), every command's error boundary (console), disk checks (storage). Layer 4, light: no torch, no deepspeed.
May import: ds_exp.core, ds_exp.config, ds_exp.data, ds_exp.resume; only cli.run_job imports the training stack, once
validation has passed."""
