"""Starting a process: the command line (cli), the launch (environment), validation, the run directory's guards and
lock, logs, every command's error boundary (console). Layer 4, light: no torch. May import: ds_exp.core, ds_exp.config,
ds_exp.data, ds_exp.resume; only cli.run_job imports the training stack."""
