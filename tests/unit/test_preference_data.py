"""Preference pairs are SFT's examples twice (ds_exp/data/pipeline.py, pairs=True): the chosen half of every pair is
exactly the SFT example of its row (the same template, tokens and labels: the answer's tokens only), the rejected
half differs only in the answer, and both are cached with the tokenized data."""

from __future__ import annotations

from ds_exp.data.pipeline import prepare_sft_data
from ds_exp.model.tokenizer import load_tokenizer

IGNORE = -100


def test_pairs_are_sft_examples_ending_on_either_answer(compose_cfg, tmp_path):
    cfg = compose_cfg("data.synthetic.num_train=64", "data.synthetic.num_eval=8", f"data.cache_dir={tmp_path}")
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    sft = prepare_sft_data(cfg.data, tokenizer, seed=1)
    pairs = prepare_sft_data(cfg.data, tokenizer, seed=1, pairs=True)
    assert (len(pairs.train), len(pairs.eval)) == (len(sft.train), len(sft.eval)) == (64, 8)
    assert sft.train["input_ids"] == pairs.train["chosen_input_ids"]
    assert sft.train["labels"] == pairs.train["chosen_labels"]
    for row in pairs.train:
        start = next(i for i, label in enumerate(row["chosen_labels"]) if label != IGNORE)
        assert row["rejected_input_ids"][:start] == row["chosen_input_ids"][:start]  # the same prompt
        assert row["rejected_labels"][:start] == [IGNORE] * start  # prompt tokens never count
        assert row["rejected_labels"][start:] == row["rejected_input_ids"][start:]  # the answer's all do
        assert row["rejected_input_ids"] != row["chosen_input_ids"]
    assert pairs.stats["cache_path"] != sft.stats["cache_path"]
    assert prepare_sft_data(cfg.data, tokenizer, seed=1, pairs=True).stats["cache_hit"]
