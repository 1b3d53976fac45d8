"""The SFT data pipeline: sources -> phase splits -> blend -> templates -> tokenize -> Arrow cache.

Light: no torch, no deepspeed (datasets and tokenizers only where data is built). Owns: reading the user's
files (sources, formats, textfiles, conversations), DeepSpeed-Chat's phase splits (splits), the prompt templates
(templates), tokenizing and packing (encode), the cache (cache), the tokenizer (tokenizer), checks of the data
config (checks) and the pipeline that ties them (pipeline). May import: ds_exp.errors, ds_exp.config.
Batching (the collator and the resumable sampler) needs torch and lives in ds_exp.train.
"""
