"""Continuing a run: a run directory's checkpoints on disk (store: tags, completeness markers, `latest`, which
one a resume continues from), what a checkpoint depends on and what a resume may change (settings, trajectory;
settings.check_resume_target: before Hydra writes into a run directory).

Layer 3, light: no torch, no deepspeed. May import: ds_exp.core, ds_exp.config, ds_exp.data.
Loading and saving checkpoints with an engine is ds_exp.checkpoint's.
"""
