"""Use what you trained: `python -m ds_exp.export CHECKPOINT [DIR]` (any complete checkpoint to Hugging Face format,
at any ZeRO stage, LoRA merged or as an adapter) and `python -m ds_exp.chat DIR` (talk to an export).

cli.py parses and refuses without torch (what it is pointed at: ds_exp/launch/exports.py); export.py reads a
checkpoint in one process and writes it as the run's own export would be; chat.py generates as the run did.
"""
