"""The configuration, before anything runs: the typed schema, the DeepSpeed config (resolvers, ds_config), checks of
values and combinations, the optimizers' table, a user's config files, the run's arithmetic (batch, plan, memory_plan),
precision, credentials (secret_names, secret_shapes, secrets) and ds_exp's own paths. Layer 1, light: no torch, no
deepspeed. May import: ds_exp.core."""
