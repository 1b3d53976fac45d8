"""Data shipped with ds_exp: the embedded byte-level BPE tokenizer (`tokenizer/`), rebuilt by its build_tokenizer."""
