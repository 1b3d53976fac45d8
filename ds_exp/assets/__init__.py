"""Data shipped with ds_exp: the embedded byte-level BPE tokenizer (`tokenizer/`).

Rebuilt by `python -m ds_exp.assets.build_tokenizer`.
"""
