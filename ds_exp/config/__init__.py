"""The configuration, before anything runs: the typed schema (schema) Hydra's composition is converted to once,
the interpolations that build the DeepSpeed config (resolvers, ds_config: a user's JSON, Hugging Face's "auto"),
the checks of values and combinations (validate, model_checks), the run's arithmetic (plan: steps, batches;
memory_plan: bytes per rank, on disk), the precision an accelerator gets (precision), credential-like values
(secrets), where ds_exp's own files are (paths), and the typed eval group with lm-eval's settings (eval_schema).

Layer 1, light: no torch, no deepspeed. May import: ds_exp.core.
"""
