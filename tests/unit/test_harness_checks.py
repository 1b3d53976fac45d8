"""lm-evaluation-harness scores without a model (issue 33): the built-in tasks generated from a seed and loaded by
lm-eval itself, a task YAML's metrics and the objectives they allow, the sweep report's column per task metric, an
optuna study maximizing a score, and what `python -m ds_exp.evaluate` refuses: one line, exit 2, nothing written,
before torch is imported. (The scores themselves: tests/integration/test_harness.py.)"""

from __future__ import annotations

import csv
import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ds_exp.config.schema import SyntheticDataConfig
from ds_exp.data.synthetic import generate
from ds_exp.evaluation.checks import objective_problems, resolve_tasks
from ds_exp.evaluation.tasks import BuiltinSettings, write_builtin_tasks
from tests.training import REPO, user_env
from tests.unit.test_use_refusals import make_run

SYNTHETIC = SyntheticDataConfig(num_train=400)


def right_answer(question: str) -> str:
    """What the embedded task's generator answers (ds_exp/data/synthetic.py), told from the question alone."""
    head, _, rest = question.partition(": ")
    if head == "reverse the words":
        return " ".join(reversed(rest.split()))
    if head == "repeat the words":
        return rest
    if head == "sort the digits":
        return " ".join(sorted(rest.split()))
    facts = dict(re.findall(r"the (\w+) is (\w+)", question.split(". what")[0]))
    return facts[re.search(r"what color is the (\w+)\?", question).group(1)]


def test_the_built_in_tasks_are_generated_from_a_seed_and_lm_eval_loads_them(tmp_path):
    from lm_eval.tasks import TaskManager

    words = lambda text: len(text.split())  # noqa: E731 (the tokenizer the passkey lengths are counted with)
    settings = BuiltinSettings(SYNTHETIC, (96, 160))
    directory = write_builtin_tasks(["ds_exp_synthetic", "ds_exp_passkey"], tmp_path, settings, words)
    assert write_builtin_tasks(["ds_exp_synthetic", "ds_exp_passkey"], tmp_path, settings, words) == directory
    rows = [json.loads(line) for line in (directory / "ds_exp_synthetic.jsonl").read_text().splitlines()]
    trained = {row["prompt"] for row in generate(SYNTHETIC.num_train, 0, SYNTHETIC.seed)[0]}
    assert len(rows) == 200 and not any(row["question"] in trained for row in rows)
    for row in rows:
        assert len(set(row["choices"])) == 4 and row["choices"][row["answer"]] == right_answer(row["question"]), row
    assert {row["answer"] for row in rows} == {0, 1, 2, 3}  # the right answer is not always in one place
    for length in (96, 160):
        keys = [json.loads(line) for line in (directory / f"ds_exp_passkey_{length}.jsonl").read_text().splitlines()]
        assert len(keys) == 20 and all(key["answer"] in key["question"] for key in keys)
        assert all(length - 32 <= words(key["question"]) <= length - 16 for key in keys)
    group = yaml.safe_load((directory / "ds_exp_passkey.yaml").read_text())
    assert group["task"] == ["ds_exp_passkey_96", "ds_exp_passkey_160"]
    manager = TaskManager(include_defaults=False, include_path=str(directory))
    loaded = manager.load(["ds_exp_synthetic", "ds_exp_passkey"])
    assert sorted(loaded["tasks"]) == ["ds_exp_passkey_160", "ds_exp_passkey_96", "ds_exp_synthetic"]
    assert len(loaded["tasks"]["ds_exp_synthetic"].eval_docs) == 200
    other = write_builtin_tasks(["ds_exp_synthetic"], tmp_path, BuiltinSettings(SyntheticDataConfig(seed=1), ()), words)
    assert (
        other != directory
        and (other / "ds_exp_synthetic.jsonl").read_text() != (directory / "ds_exp_synthetic.jsonl").read_text()
    )


def test_a_task_yaml_names_its_metrics_and_an_objective_must_be_one_of_them(tmp_path):
    (tmp_path / "qa.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    (tmp_path / "qa.yaml").write_text(
        f"task: qa\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'qa.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: question\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: exact_match\nfilter_list:\n"
        "  - name: strict\n    filter: [{function: take_first}]\n"
        "  - name: none\n    filter: [{function: take_first}]\n"
    )
    yaml_path = str(tmp_path / "qa.yaml")
    (spec, synthetic), problems = resolve_tasks([yaml_path, "ds_exp_synthetic"], (64,), key="eval.harness.tasks")
    assert problems == [] and spec.name == "qa" and spec.kind == "file"
    assert spec.metrics == {"qa": ("exact_match/strict", "exact_match")} and synthetic.metrics == {
        "ds_exp_synthetic": ("acc",)
    }
    key = "hydra.sweeper.objective"
    assert objective_problems("harness.qa.exact_match/strict", [yaml_path], (64,), key=key) == []
    assert objective_problems("final_eval.eval_loss", [], (64,), key=key) == []
    (wrong,) = objective_problems("harness.qa.acc", [yaml_path], (64,), key=key)
    assert wrong == (
        "hydra.sweeper.objective=harness.qa.acc: the runs' lm-eval scores hold no such number; choose one of "
        "harness.qa.exact_match/strict, harness.qa.exact_match"
    )
    (none,) = objective_problems("harness.qa.acc", [], (64,), key=key)
    assert "the runs score no lm-eval task; set eval.harness.tasks=[...]" in none


def _job(sweep: Path, name: str, summary: object) -> None:
    (sweep / name / ".hydra").mkdir(parents=True)
    (sweep / name / ".hydra" / "overrides.yaml").write_text(f"- lora.dim={name}\n")
    (sweep / name / "summary.json").write_text(json.dumps(summary))


def test_the_sweep_report_has_a_column_per_task_metric(tmp_path, capsys):
    from ds_exp.sweeps.report import write_report

    scores = {"0": {"ds_exp_synthetic": {"acc": 0.5}}, "8": {"ds_exp_synthetic": {"acc": 0.75}, "qa": {"f1": None}}}
    for name, harness in scores.items():
        _job(tmp_path, name, {"status": "completed", "world_size": 1, "harness": harness})
    _job(tmp_path, "16", {"status": "completed", "harness": ["not", "a", "mapping"]})
    rows = write_report(tmp_path, [tmp_path / n for n in ("0", "8", "16")])
    with (tmp_path / "report.csv").open() as fh:
        reader = csv.DictReader(fh)
        columns, table = list(reader.fieldnames or []), list(reader)
    at = columns.index("harness.ds_exp_synthetic.acc")
    assert columns[at - 1] == "perplexity" and columns[at + 1 : at + 3] == ["harness.qa.f1", "wall_time_s"]
    assert [r["harness.ds_exp_synthetic.acc"] for r in table] == ["0.5", "0.75", ""]
    assert rows[2]["status"] == "damaged" and "harness is not numbers" in rows[2]["error"]
    assert "| harness.ds_exp_synthetic.acc | harness.qa.f1 |" in (tmp_path / "report.md").read_text()
    assert "job 16" in capsys.readouterr().err


def test_a_study_maximizing_a_harness_score_picks_the_best_trial(tmp_path):
    """The sweeper takes harness.<task>.<metric> as its objective, reads each trial's value from its summary.json as
    for any objective, and optuna's best trial is the one that scored highest."""
    import optuna

    from ds_exp.sweeps.optuna_study import StudySweeper
    from ds_exp.sweeps.study_files import outcome

    objective = "harness.ds_exp_synthetic.acc"
    StudySweeper(objective=objective, direction="maximize", study_name="s").check_settings()
    with pytest.raises(Exception, match=r"hydra\.sweeper\.objective=harness: no run's summary\.json reports it"):
        StudySweeper(objective="harness", study_name="s").check_settings()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    for number, acc in enumerate([0.31, 0.82, 0.55]):
        trial = study.ask({"lr": optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True)})
        _job(tmp_path, str(number), {"status": "completed", "harness": {"ds_exp_synthetic": {"acc": acc}}})
        state, value, error, _ = outcome(tmp_path / str(number), objective, None)
        assert (state, error) == ("COMPLETE", None)
        study.tell(trial, value)
    assert (study.best_trial.number, study.best_value) == (1, 0.82)


def _export(root: Path) -> Path:
    """A model directory the refusals look at: a small Llama's config (64 positions) and the embedded tokenizer (no
    weights: everything here is refused before any would load)."""
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))
    shutil.copy(REPO / "ds_exp" / "assets" / "tokenizer" / "tokenizer.json", root / "model")
    return root / "model"


def _adapter(root: Path) -> None:
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_config.json").write_text("{}")


def mc_task(root: Path, name: str, rows: list[object], text: str = "question", task: str | None = None) -> None:
    """A multiple-choice task YAML in lm-eval's format (its data a JSON-lines file beside it)."""
    (root / f"{name}.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    (root / f"{name}.yaml").write_text(
        f"task: {task or name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / name}.jsonl\n"
        f"test_split: test\noutput_type: multiple_choice\ndoc_to_text: {json.dumps(text)}\n"
        "doc_to_choice: choices\ndoc_to_target: answer\n"
    )


QUESTIONS = [{"question": f"{i}+{i}?", "choices": [str(2 * i), str(2 * i + 1)], "answer": 0} for i in range(20)]


def _tasks(root: Path) -> None:
    """The issue-39 §4 cases, each a task file: what lm-eval failed on after loading, or scored silently."""
    mc_task(root, "qa", QUESTIONS)
    mc_task(root, "long", [{"question": "pick", "choices": ["word " * 100, "b"], "answer": 0}])
    unasked = [{"q": f"{i}?", "choices": ["a", "b"], "answer": 0} for i in range(3)]
    mc_task(root, "unasked", [QUESTIONS[0], *unasked], text="Question: {{question}}\nAnswer:")
    mc_task(root, "misnamed", unasked, text="Question: {{question}}\nAnswer:")
    mc_task(root, "broken", [QUESTIONS[0], '{"question": "2+2?", "choices": ["4"'])
    (root / "empty.yaml").write_text("group: empty\ntask: []\n")


REFUSALS = [
    ("no such target", ["{tmp}/nope", "ds_exp_synthetic"], "{tmp}/nope: no such directory", None),
    ("not a model", ["{tmp}/empty", "ds_exp_synthetic"], "{tmp}/empty: not a model: no config.json", None),
    ("a LoRA adapter", ["{tmp}/adapter", "ds_exp_synthetic"], "is a LoRA adapter, not a whole model", _adapter),
    ("a run without its export", ["{run}", "ds_exp_synthetic"], "is a run directory without its final export", None),
    ("an unknown task", ["{model}", "arc_eazy"], "TASK: arc_eazy: lm-eval knows no such task", None),
    ("a missing task YAML", ["{model}", "{tmp}/qa.yaml"], "{tmp}/qa.yaml: no such task YAML file", None),
    ("a limit of 0", ["{model}", "ds_exp_synthetic", "--limit", "0"], "--limit=0.0: give a number", None),
    ("an unknown device", ["{model}", "ds_exp_synthetic", "--device", "tpu"], "--device=tpu: use auto, cpu", None),
    ("passkey lengths", ["{model}", "ds_exp_passkey", "--passkey-lengths", "1k"], "--passkey-lengths=1k: give", None),
    # issue 39 §4: what failed after minutes of loading (AssertionError, ZeroDivisionError, torch's CUDA, random's
    # "Sample larger than population"), or was scored silently ("Question: None", a passkey cut off: 0.0)
    (
        "a choice longer than the model",
        ["{model}", "{tmp}/long.yaml"],
        "TASK: {tmp}/long.yaml: row 1 of {tmp}/long.jsonl: an answer of 101 tokens is longer than the 64 positions",
        _tasks,
    ),
    ("a group with no tasks", ["{model}", "{tmp}/empty.yaml"], "its group empty holds no tasks", _tasks),
    ("cuda on a CPU machine", ["{model}", "{tmp}/qa.yaml", "--device", "cuda"], "--device=cuda: this machine", _tasks),
    (
        "more few-shot examples than questions",
        ["{model}", "{tmp}/qa.yaml", "--num-fewshot", "100"],
        "TASK: {tmp}/qa.yaml: --num-fewshot=100 few-shot examples, but the task has 20 to draw them from",
        _tasks,
    ),
    (
        "rows without the field the prompt reads",
        ["{model}", "{tmp}/unasked.yaml"],
        "rows 2, 3, 4 of {tmp}/unasked.jsonl (3 of 4 questions) have no field question, which its doc_to_text reads",
        _tasks,
    ),
    (
        "a passkey longer than the model",
        ["{model}", "ds_exp_passkey", "--passkey-lengths", "4096"],
        "--passkey-lengths: ds_exp_passkey's prompts of 4096 tokens are beyond the 64 positions of {tmp}/model",
        None,
    ),
    (
        "a field no row has",
        ["{model}", "{tmp}/misnamed.yaml"],
        "TASK: {tmp}/misnamed.yaml: no row of {tmp}/misnamed.jsonl has the field question, which its doc_to_text reads",
        _tasks,
    ),
    (
        "a data row that is not JSON",
        ["{model}", "{tmp}/broken.yaml"],
        "{tmp}/broken.yaml: its data file {tmp}/broken.jsonl cannot be read: line 2 is not valid JSON",
        _tasks,
    ),
]


@pytest.mark.parametrize(("args", "expected", "setup"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_evaluate_refuses_in_one_line_and_writes_nothing(args, expected, setup, tmp_path, capsys, monkeypatch):
    from ds_exp.evaluation.cli import main

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # a CPU machine, even where a GPU is
    run, model = make_run(tmp_path), _export(tmp_path)
    (tmp_path / "empty").mkdir()
    if setup is not None:
        setup(tmp_path)
    given = [a.replace("{tmp}", str(tmp_path)).replace("{run}", str(run)).replace("{model}", str(model)) for a in args]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert main(given) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds_exp: error: ") and err.count("ds_exp: error") == 1 and "Traceback" not in err, err
    assert expected.replace("{tmp}", str(tmp_path)) in err, err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_evaluate_refuses_a_full_disk_before_loading(tmp_path, mount_tmpfs, capsys):
    """Issue 39 §4: a full disk under --output ended in `failed unexpectedly (OSError: No space left on device)`
    after the model was scored."""
    from ds_exp.evaluation.cli import main

    disk = mount_tmpfs("16k")
    _tasks(tmp_path)
    assert main([str(_export(tmp_path)), str(tmp_path / "qa.yaml"), "--output", str(disk / "scores")]) == 2
    err = capsys.readouterr().err
    assert f"ds_exp: error: not enough disk space for --output={disk / 'scores'}: 16.00 KiB free" in err, err
    assert "point --output at a larger disk" in err and not list(disk.iterdir())


def test_evaluate_answers_help_and_refusals_without_torch(tmp_path):
    code = (
        "import sys\n"
        "from ds_exp.evaluation.cli import main\n"
        f"codes = [main([{str(tmp_path)!r}, 'ds_exp_synthetic']), main([{str(tmp_path / 'x')!r}, 'x'])]\n"
        "print(codes, sorted(m for m in ('torch', 'deepspeed', 'transformers', 'lm_eval') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=user_env(), capture_output=True, text=True)
    assert proc.stdout.strip() == "[2, 2] []", proc.stdout + proc.stderr
    shown = subprocess.run([sys.executable, "-m", "ds_exp.evaluate", "--help"], env=user_env(), capture_output=True)
    assert shown.returncode == 0 and b"ds_exp_passkey" in shown.stdout


def test_lm_evals_task_index_cache_is_checked_not_trusted(tmp_path, monkeypatch, caplog):
    """Issue 39 §1/§3: the index ds_exp keeps of lm-eval's registry (~/.cache/ds_exp) is read through one check: an
    entry of another shape is built again and said once (it was a TypeError in every later run); the directory is
    made owner-only, and a link planted in its place is refused in one line."""
    import lm_eval.tasks

    from ds_exp.evaluation import checks

    built = []

    class Registry:  # lm-eval's TaskManager, as far as the index is read (its real one reads ~15000 YAML files)
        def __init__(self) -> None:
            built.append(1)
            kind = type("Kind", (), {"name": "TASK"})
            self.task_index = {"arc_easy": type("Entry", (), {"kind": kind, "yaml_path": "/a.yaml", "tags": set()})}

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Registry)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    checks.registry_index.cache_clear()
    assert checks.registry_index() == {"arc_easy": ["TASK", "/a.yaml", []]} and len(built) == 1
    (saved,) = (tmp_path / "xdg" / "ds_exp").glob("lm_eval_tasks-*.json")
    assert (tmp_path / "xdg" / "ds_exp").stat().st_mode & 0o777 == 0o700
    checks.registry_index.cache_clear()
    assert checks.registry_index() == {"arc_easy": ["TASK", "/a.yaml", []]} and len(built) == 1  # read back
    saved.write_text(json.dumps({"format": 1, "tasks": {"arc_easy": 5}}))
    for _ in range(2):
        checks.registry_index.cache_clear()
        with caplog.at_level(logging.WARNING, logger="ds_exp.cache"):
            assert checks.registry_index()["arc_easy"] == ["TASK", "/a.yaml", []]
    assert len(built) == 2 and [r.getMessage().endswith("built again") for r in caplog.records] == [True]

    (tmp_path / "xdg").rename(tmp_path / "elsewhere")
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "ds_exp").symlink_to(tmp_path / "elsewhere" / "ds_exp")
    checks.registry_index.cache_clear()
    _, problems = resolve_tasks(["arc_easy"], (64,), key="TASK")
    assert problems == [
        f"TASK: arc_easy: lm-eval's task index cannot be kept: {tmp_path}/xdg/ds_exp is a symbolic "
        "link; ds_exp does not follow links there: remove it and run again"
    ]
    checks.registry_index.cache_clear()
