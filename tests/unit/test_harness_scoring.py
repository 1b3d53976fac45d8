"""The evaluation as a user sees it, in-process on a small model (issues 39 §2-§4 and 41 §4): piped, `python -m
ds_exp.evaluate` says its progress in plain lines (lm-eval's own bars go to its log) and how many questions each
score rests on, warning when they are few; a token in a task YAML reaches no file and not the console; a task whose
prompts only its own code makes is measured, and refused, before the weights load; the base scores' cache is checked,
not trusted. (Refusals before anything loads: tests/unit/test_harness_checks.py; whole runs: tests/integration/
test_harness.py.)"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest

from tests.training import REPO
from tests.unit.test_harness_checks import QUESTIONS, mc_task

PROGRESS = re.compile(r"ds_exp: scoring qa: requests (\d+)/40 \((\d+)%\)(; about [\dhms. ]+ left)?")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    """A one-layer Llama of 128 positions and the embedded tokenizer: lm-eval scores 20 questions in a second."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("model")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "ds_exp" / "assets" / "tokenizer")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_piped_evaluation_says_its_progress_and_what_each_score_rests_on(small_model, tmp_path, capsys):
    """Issue 41 §4: 7.5 minutes of silence after `scoring ...`. Piped, plain lines at each tenth of the requests
    (as training's); issue 39 §4: `--limit 0.0001` scored one question and said nothing."""
    from ds_exp.evaluation.cli import main

    mc_task(tmp_path, "qa", QUESTIONS)
    assert main([str(small_model), str(tmp_path / "qa.yaml"), "--output", str(tmp_path / "all")]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert all(line.startswith("ds_exp: ") for line in lines), err  # lm-eval's bars are not the console's
    counts = [int(m.group(1)) for m in map(PROGRESS.fullmatch, lines) if m]
    assert len(counts) >= 3 and counts == sorted(counts) and counts[-1] == 40, err
    assert lines[-1] == "ds_exp: scoring qa: requests 40/40 (100%)"
    assert "qa    acc          -" in out and out.splitlines()[0].endswith("stderr  questions") and " 20\n" in out
    assert "Running loglikelihood requests" in (tmp_path / "all" / "lm_eval.log").read_text()  # its bar: the log's

    assert (
        main([str(small_model), str(tmp_path / "qa.yaml"), "--limit", "0.0001", "--output", str(tmp_path / "1")]) == 0
    )
    out, err = capsys.readouterr()
    assert [line.split()[-1] for line in out.splitlines()[1:3]] == ["1", "1"]  # the questions column
    assert "ds_exp: warning: qa's scores rest on 1 question: too few to tell a model from another" in err, err
    assert json.loads((tmp_path / "1" / "harness.json").read_text())["questions"] == {"qa": 1}


def test_a_token_in_a_task_yaml_reaches_no_file_and_not_the_console(small_model, tmp_path, capsys):
    """Issue 39 §2: lm-eval copies a task's config, dataset_kwargs and all, into results_*.json; a token there (by
    its key's name, and by its shape under an innocent key) is blanked in every file the evaluation writes."""
    from ds_exp.evaluation.cli import main

    by_name, by_shape = "kept-by-its-name-5d1e", "hf_" + "Zq8Wv2Lm4Rt6Yp1Xc3Nb5Kd7Hs9Gf0Ja"
    mc_task(tmp_path, "qa", QUESTIONS[:4])
    task = (tmp_path / "qa.yaml").read_text().replace("dataset_kwargs:\n", f"dataset_kwargs:\n  token: {by_name}\n")
    (tmp_path / "qa.yaml").write_text(task + f"metadata:\n  version: 1\n  origin: {by_shape}\n")
    assert main([str(small_model), str(tmp_path / "qa.yaml"), "--output", str(tmp_path / "out")]) == 0
    console = "".join(capsys.readouterr())
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    (results,) = (tmp_path / "out" / "tuned" / "qa").glob("results_*.json")
    assert json.loads(results.read_text())["configs"]["qa"]["dataset_kwargs"]["token"] == "<redacted>"
    assert len(files) >= 5 and any(p.name.startswith("samples_") for p in files)
    for secret in (by_name, by_shape):
        assert secret not in console and not [p for p in files if secret in p.read_text(errors="replace")]


def test_a_prompt_only_its_own_code_makes_is_measured_before_the_weights_load(
    small_model, tmp_path, capsys, monkeypatch
):
    """A task's `!function` is not run by validation; the scoring runs it, with the export's own tokenizer, and
    refuses a prompt beyond the model's positions before lm-eval loads the weights."""
    from ds_exp.evaluation import harness
    from ds_exp.evaluation.cli import main

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(harness, "load_model", never)
    mc_task(tmp_path, "qa", QUESTIONS[:3])
    (tmp_path / "words.py").write_text("def text(doc):\n    return 'word ' * 200 + doc['question']\n")
    task = (tmp_path / "qa.yaml").read_text().replace('doc_to_text: "question"', "doc_to_text: !function words.text")
    (tmp_path / "qa.yaml").write_text(task)
    assert main([str(small_model), str(tmp_path / "qa.yaml"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"ds_exp: error: TASK: {tmp_path / 'qa.yaml'}: rows 1, 2, 3 of {tmp_path / 'qa.jsonl'}" in err, err
    assert "tokens with its longest answer, beyond the 128 positions" in err and not (tmp_path / "out").exists()


def test_a_base_score_of_another_shape_is_a_miss_scored_again_and_said_once(tmp_path, caplog):
    """Issue 39 §3: `{"format": 1, "acc": 0.5}` in a base-score entry made every later evaluation of that base fail
    with KeyError: 'values'. And the cache's directory is the user's own: a planted link or another user's is
    refused in one line."""
    from ds_exp.core.errors import ConfigError
    from ds_exp.evaluation.harness import SCORES, BaseCache

    cache = BaseCache(tmp_path / "cache", {"model": "m"}, {"limit": None})
    assert (tmp_path / "cache" / "harness-base").stat().st_mode & 0o777 == 0o700
    entry = cache.entry("qa")
    entry.mkdir()
    (entry / SCORES).write_text(json.dumps({"format": 1, "acc": 0.5}))
    with caplog.at_level(logging.WARNING, logger="ds_exp.cache"):
        assert cache.read("qa") is None and cache.read("qa") is None
    (said,) = [r.getMessage() for r in caplog.records]
    assert f"cache entry {entry / SCORES} is not what ds_exp writes" in said and said.endswith("built again")
    (tmp_path / "files").mkdir()
    scores = {"values": {"qa": {"acc": 0.5}}, "stderr": {"qa": {"acc": 0.1}}, "questions": {"qa": 20}}
    cache.store("qa", tmp_path / "files", scores)
    assert cache.read("qa") == scores

    (tmp_path / "planted").mkdir()
    (tmp_path / "planted" / "harness-base").symlink_to(tmp_path / "cache" / "harness-base")
    with pytest.raises(ConfigError, match=r"^data\.cache_dir=.*planted/harness-base is a symbolic link"):
        BaseCache(tmp_path / "planted", {"model": "m"}, {})
    os.chown(tmp_path / "cache" / "harness-base", 4242, -1)
    with pytest.raises(ConfigError, match=r"harness-base belongs to another user \(uid 4242\)"):
        BaseCache(tmp_path / "cache", {"model": "m"}, {})


def test_on_a_terminal_the_scoring_draws_a_bar(monkeypatch):
    """A terminal gets a bar (tqdm's, on the console), not the plain lines of a pipe."""
    import io

    from ds_exp.evaluation import harness

    console = io.StringIO()
    monkeypatch.setattr(harness, "on_terminal", lambda: True)
    monkeypatch.setattr("sys.stderr", console)
    progress = harness.Progress("scoring qa (the base model)")
    progress.start(40)
    for _ in range(5):
        progress.advance(8)
    progress.done()
    progress.close()
    drawn = console.getvalue()
    assert "scoring qa (the base model): 100%|" in drawn and "40/40" in drawn and "ds_exp: " not in drawn, drawn
