"""The SFT data pipeline: sources -> phase splits -> blend -> templates -> tokenize -> Arrow cache. Batching needs torch
and lives in ds_exp.train. Layer 2, light: no torch, no deepspeed (datasets only where data is built). May import:
ds_exp.core, ds_exp.config."""
