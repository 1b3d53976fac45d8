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


def test_conversational_preference_rows_are_the_text_rows_pairs(compose_cfg, tmp_path):
    """Hugging Face's conversational preference rows (TRL's explicit prompt: prompt, chosen and rejected as message
    lists; implicit: chosen and rejected each the whole conversation) give the pairs their text rows give."""
    import json

    import pytest

    from ds_exp.core.errors import DataError

    rows = [(f"say {word} twice", f"{word} {word}", f"{word}") for word in ("red", "blue", "gold", "pink", "owl")] * 8
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    bot = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    layouts = {
        "text": [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in rows],
        "explicit": [{"prompt": [user(p)], "chosen": [bot(c)], "rejected": [bot(r)]} for p, c, r in rows],
        "implicit": [{"chosen": [user(p), bot(c)], "rejected": [user(p), bot(r)]} for p, c, r in rows],
    }
    pairs = {}
    for name, records in layouts.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        cfg = compose_cfg("data=local", f"data.sources.0.path={path}", f"data.cache_dir={tmp_path / name}")
        pairs[name] = prepare_sft_data(cfg.data, load_tokenizer(cfg.model, cfg.data), seed=1, pairs=True)
    for name in ("explicit", "implicit"):
        for split in ("train", "eval"):
            assert getattr(pairs[name], split).to_dict() == getattr(pairs["text"], split).to_dict(), (name, split)
    # the two conversations of an implicit row must share what comes before their answers
    bad = tmp_path / "bad.jsonl"
    good = {"chosen": [user("a"), bot("b")], "rejected": [user("a"), bot("c")]}
    bad.write_text(json.dumps(good) + "\n" + json.dumps({**good, "rejected": [user("d"), bot("c")]}) + "\n")
    cfg = compose_cfg("data=local", f"data.sources.0.path={bad}", f"data.cache_dir={tmp_path / 'bad'}")
    with pytest.raises(DataError, match=r"bad.jsonl:2: 'chosen' and 'rejected' differ before their answers"):
        prepare_sft_data(cfg.data, load_tokenizer(cfg.model, cfg.data), seed=1, pairs=True)
