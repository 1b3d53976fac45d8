"""The SFT data pipeline: sources -> phase splits -> blend -> templates -> tokenize -> Arrow cache.

Layer 2, light: no torch, no deepspeed (datasets only where data is built). Owns: reading the user's
files (sources, formats, textfiles, conversations), DeepSpeed-Chat's phase splits (splits), the prompt templates
(templates), tokenizing and packing (encode), the cache (cache), checks of the data config (checks), and the
pipeline that ties them (pipeline). May import: ds_exp.core, ds_exp.config.
Batching (the collator and the resumable sampler) needs torch and lives in ds_exp.train.
"""
