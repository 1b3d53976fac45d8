"""Continuing a run: its checkpoints on disk (store), one trajectory per run directory (branches), and what a resume may
change (settings, trajectory). Loading and saving with an engine is ds_exp.checkpoint's. Layer 3, light: no torch, no
deepspeed. May import: ds_exp.core, ds_exp.config, ds_exp.data."""
