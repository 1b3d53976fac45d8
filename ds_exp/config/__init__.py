"""The configuration, before anything runs: the typed schema (schema) Hydra's composition is converted
to once,
the interpolations that build the DeepSpeed config (resolvers, ds_config: a user's JSON, Hugging Face's "auto"),
the checks of values and combinations (validate, model_checks; place_checks: where a run's name and relative
paths put it), the optimizers as one table (optimizers, optimizer_settings; optimizer_checks: what an entry
cannot do with the rest), a user's own config files (config_files), the run's arithmetic (batch: the global batch;
plan: the run's plan for every caller, steps; memory_plan: bytes per rank, on disk), the precision an accelerator
gets (precision), credentials by name and by shape (secret_names, secret_shapes, secrets), where ds_exp's own files
are (paths).

Layer 1, light: no torch, no deepspeed. May import: ds_exp.core.
"""
