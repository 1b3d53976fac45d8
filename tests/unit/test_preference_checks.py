"""Preference tuning's refusals (ds_exp/preference/checks.py): one line each, before anything heavy, naming the key or
the file and row, and the fix."""

from __future__ import annotations

import json

import pytest

from ds_exp.core.errors import ConfigError
from ds_exp.launch.validation import validate


def problems(compose_cfg, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides), accelerator="cpu")
    return str(err.value)


def rows_file(tmp_path, *rows: dict) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


ROW = {"prompt": "Say hi.", "chosen": "Hi.", "rejected": "Bye."}


def test_sft_data_is_no_preference_data(compose_cfg, tmp_path):
    path = rows_file(tmp_path, {"prompt": "Say hi.", "chosen": "Hi."}, {"prompt": "Say no.", "chosen": "No."})
    said = problems(compose_cfg, "objective=dpo", "data=local", f"data.sources.0.path={path}")
    assert "objective=dpo: data.sources[0] has no rejected answers ('rejected'): it is SFT data" in said


@pytest.mark.parametrize(
    ("row", "what"),
    [
        ({"prompt": "Say no.", "chosen": "No."}, "no rejected answer ('rejected')"),
        ({"prompt": "Say no.", "chosen": "No.", "rejected": "No."}, "chosen and rejected are the same answer"),
    ],
)
def test_a_bad_row_is_named_by_file_and_line(compose_cfg, tmp_path, row, what):
    path = rows_file(tmp_path, ROW, ROW, row)
    said = problems(compose_cfg, "objective=reward", "data=local", f"data.sources.0.path={path}")
    assert f"data.sources[0]: {path}:3: {what}" in said


def test_combinations_that_cannot_work(compose_cfg):
    said = problems(compose_cfg, "objective=dpo", "data.packing=true", "objective.reference=adapters_off")
    assert "data.packing=true: objective=dpo cannot use it" in said
    assert "objective.reference=adapters_off needs LoRA adapters" in said
    # a value out of its range is said first, alone: the combinations are judged between valid values
    said = problems(compose_cfg, "objective=dpo", "data.packing=true", "objective.beta=0")
    assert "objective.beta=0.0: must be > 0" in said and "data.packing" not in said
    said = problems(compose_cfg, "objective=reward", "lora.dim=8")
    assert "lora.modules_to_save=[score]" in said
    said = problems(compose_cfg, "objective=reward", "eval.harness.tasks=[ds_exp_synthetic]")
    assert "eval.harness.tasks=[ds_exp_synthetic]: objective=reward trains a reward model, which writes no" in said


def test_a_reward_model_is_not_evaluated_or_chatted_with_as_a_language_model(tmp_path, capsys):
    """transformers would load a reward model's export as a language model without its head: lm-eval's scores and
    the chat's answers would mean nothing. Refused from its config.json, before any weight is read."""
    from ds_exp.evaluation.cli import main as evaluate
    from ds_exp.exports.cli import chat_main

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    for command, args in ((evaluate, [str(tmp_path), "ds_exp_synthetic"]), (chat_main, [str(tmp_path)])):
        assert command(args) == 2
        said = capsys.readouterr().err
        assert f"ds_exp: error: {tmp_path} is a reward model (objective=reward): it scores answers" in said, said


def test_sft_and_the_embedded_pairs_pass(compose_cfg):
    validate(compose_cfg(), accelerator="cpu")
    validate(compose_cfg("objective=dpo", "lora.dim=8"), accelerator="cpu")
    validate(compose_cfg("objective=reward", "lora.dim=8", "lora.modules_to_save=[score]"), accelerator="cpu")
