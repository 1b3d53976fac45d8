"""Did the fine-tune help? (issue 33) lm-evaluation-harness scores of a run's export beside its base model's: the
default run with eval.harness scores its export well above its base on ds_exp_synthetic, and the numbers reach
harness.json, summary.json, metrics.jsonl, wandb, TensorBoard and MLflow; the base rebuilt from train.seed is the
run's step-0 model; `python -m ds_exp.evaluate` on the run, on a checkpoint, interrupted; the base scored once for a
sweep of four jobs; SmolLM2's scores are lm-eval's own, with its chat template and without."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from tests.integration.test_trackers import history as mlflow_history
from tests.integration.test_trackers import mlflow_runs, scalars
from tests.training import train_here
from tests.wandb_files import history

TASK = "ds_exp_synthetic"
CHANCE = 0.25  # four choices


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, cache_dir):
    """The default run (its embedded defaults, in this process), scored on ds_exp_synthetic at its end and at
    step 125 (an export of train.export_every), with every tracker."""
    root = tmp_path_factory.mktemp("harness")
    with contextlib.chdir(root):  # where the run is started: MLflow's default store is outputs/mlflow.db there
        run = train_here(
            root / "run",
            f"eval.harness.tasks=[{TASK}]",
            "train.export_every=125",
            "eval.harness.every_save=true",
            "logger=[wandb,tensorboard,mlflow]",
            "logger.wandb.mode=offline",
            cache_dir=cache_dir,
            env={"WANDB_MODE": "offline"},
        )
    assert run.ok, run.explain()
    return run


def listing(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*"))


def test_the_default_run_learns_and_scores_well_above_its_base(default_run):
    summary, run_dir = default_run.summary, default_run.run_dir
    assert summary["final_eval"]["perplexity"] < 0.05 * summary["initial_eval"]["perplexity"]
    assert summary["final_eval"]["perplexity"] < 10
    record = json.loads((run_dir / "eval" / "harness.json").read_text())
    acc = record["tasks"][TASK]["acc"]
    assert set(acc) == {"base", "tuned", "stderr"} and record["settings"]["template"] == "dschat"
    assert acc["tuned"] > 2 * CHANCE and acc["tuned"] - acc["base"] > 0.25 and abs(acc["base"] - CHANCE) < 0.1, acc
    assert summary["harness"] == {TASK: {"acc": acc["tuned"]}}
    assert summary["harness_base"] == {TASK: {"acc": acc["base"]}}
    assert summary["harness_status"] == "completed" and summary["harness_error"] is None
    for side in ("tuned", "base"):  # lm-eval's own files: per-sample outputs beside harness.json
        (samples,) = (run_dir / "eval" / side / TASK).glob(f"samples_{TASK}_*.jsonl")
        assert len(samples.read_text().splitlines()) == 200
    assert (run_dir / "eval" / "harness.png").stat().st_size > 10_000
    step = json.loads((run_dir / "eval" / "hf_model-step125" / "harness.json").read_text())["tasks"][TASK]["acc"]
    assert set(step) == {"tuned", "stderr"}  # every_save: the export of step 125, tuned alone
    # issue 41 §4: piped, the console says the scoring's progress (200 questions of 4 choices) with ds_exp's lines,
    # lm-eval's bars are not on it
    said = default_run.proc.stdout
    for model in (f"{TASK}:", f"{TASK} (the tuned model):", f"{TASK} (the base model):"):
        assert f"ds_exp: scoring {model} requests 800/800 (100%)" in said, default_run.explain()
    assert "difference  stderr  questions" in said and "Running loglikelihood" not in said + default_run.proc.stderr

    # the same numbers in metrics.jsonl and in every tracker: a curve over steps (125, 250), the base at the end
    key = f"harness/{TASK}/acc"
    lines = {r["step"]: r for r in default_run.records("harness")}
    assert sorted(lines) == [125, 250] and lines[125][key] == step["tuned"] and lines[250][key] == acc["tuned"]
    assert lines[250][f"harness_base/{TASK}/acc"] == acc["base"]
    expected = [(125, step["tuned"]), (250, acc["tuned"])]
    assert _close(scalars(run_dir / "tensorboard", key), expected)
    assert _close(scalars(run_dir / "tensorboard", f"harness_base/{TASK}/acc"), [(250, acc["base"])])
    uri = f"sqlite:///{run_dir.parent / 'outputs' / 'mlflow.db'}"  # the project's store: where the run was launched
    (mlflow_run,) = mlflow_runs(uri)
    assert _close(mlflow_history(uri, mlflow_run.info.run_id, key), expected)
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    logged = history(run_file)
    assert _close([(s, logged[s][key]) for s in sorted(logged) if key in logged[s]], expected)


def _close(found: list[tuple[int, float]], expected: list[tuple[int, float]]) -> bool:
    return [s for s, _ in found] == [s for s, _ in expected] and all(
        math.isclose(a, b, rel_tol=1e-6) for (_, a), (_, b) in zip(found, expected, strict=True)
    )


def test_the_rebuilt_base_is_the_runs_step_0_model(default_run, tmp_path):
    """The base scored beside the export is rebuilt from the run's config (train.seed): its perplexity on the eval
    set is the one the run measured at step 0, before training."""
    from transformers import AutoModelForCausalLM

    from ds_exp.data.pipeline import prepare_sft_data
    from ds_exp.evaluation.harness import base_model_dir
    from ds_exp.exports.on_disk import run_config
    from ds_exp.model.tokenizer import load_tokenizer

    run_dir = default_run.run_dir
    cfg = run_config(run_dir)
    data = prepare_sft_data(cfg.data, load_tokenizer(cfg.model, cfg.data), seed=cfg.train.seed)
    with base_model_dir(cfg, run_dir / "hf_model", tmp_path) as base_dir:
        model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for row in data.eval:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
            logits = model(input_ids=ids).logits[0, :-1]
            target = labels[0, 1:]
            mask = target != -100
            loss_sum += float(torch.nn.functional.cross_entropy(logits[mask], target[mask], reduction="sum"))
            tokens += int(mask.sum())
    assert math.isclose(math.exp(loss_sum / tokens), default_run.summary["initial_eval"]["perplexity"], rel_tol=1e-4)
    assert not list(tmp_path.iterdir())  # the scratch export is gone


def test_evaluate_a_run_directory_takes_the_base_from_the_cache(default_run, capsys):
    from ds_exp.evaluation.cli import main

    run_dir = default_run.run_dir
    before = json.loads((run_dir / "eval" / "harness.json").read_text())
    assert main([str(run_dir), TASK]) == 0
    out = capsys.readouterr()
    assert "task              metric    base   tuned  difference  stderr" in out.out
    assert "(the base model's scores from the cache)" in out.out, out
    after = json.loads((run_dir / "eval" / "harness.json").read_text())
    assert after["tasks"] == before["tasks"] and after["settings"]["base_scored"] == []
    (earlier,) = (run_dir / "eval" / "earlier").iterdir()  # the run's own evaluation, set aside
    assert json.loads((earlier / "harness.json").read_text()) == before


def test_a_checkpoint_is_exported_then_scored_alone(default_run):
    from ds_exp.evaluation.cli import main

    run_dir = default_run.run_dir
    assert main([str(run_dir / "checkpoints" / "step250"), TASK, "--limit", "20", "--no-template"]) == 0
    assert (run_dir / "hf_model-step250" / "model.safetensors").is_file()  # where python -m ds_exp.export puts it
    record = json.loads((run_dir / "eval" / "hf_model-step250" / "harness.json").read_text())
    assert set(record["tasks"][TASK]["acc"]) == {"tuned", "stderr"} and record["settings"]["template"] is None


def test_ctrl_c_during_an_evaluation_leaves_the_run_as_it_was(default_run, tmp_path):
    """KeyboardInterrupt (what Ctrl-C raises) while lm-eval renders the questions: exit 130, nothing written."""
    from ds_exp.evaluation.cli import main

    interrupted = task_yaml(tmp_path, "interrupted", "raise KeyboardInterrupt")
    before = listing(default_run.run_dir)
    assert main([str(default_run.run_dir), str(interrupted)]) == 130
    assert listing(default_run.run_dir) == before


def task_yaml(directory: Path, name: str, when_asked: str) -> Path:
    """A task YAML whose doc_to_text runs `when_asked` for the documents marked `stop` (all but the first, which
    lm-eval renders when it loads the task)."""
    rows = [{"question": f"q{i}", "choices": ["a", "b"], "answer": 0, "stop": i > 0} for i in range(4)]
    (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = f"def text(doc):\n    if doc['stop']:\n        {when_asked}\n    return doc['question']\n"
    (directory / "utils.py").write_text(code)
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {directory / name}.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: !function utils.text\n"
        "doc_to_choice: choices\ndoc_to_target: answer\n"
    )
    return directory / f"{name}.yaml"


def test_the_base_is_scored_once_for_a_sweep_of_four_jobs(default_run, tmp_path):
    """Four jobs of a sweep over one base model (lora.dim and the learning rate swept; their exports differ): the
    first scores the base model, the other three read the cache."""
    from ds_exp.evaluation.checks import resolve_tasks
    from ds_exp.evaluation.harness import HarnessSettings, builtin_of, evaluate
    from ds_exp.exports.on_disk import run_config

    run_dir = default_run.run_dir
    cfg = run_config(run_dir)
    specs, problems = resolve_tasks([TASK], (64,), key="t")
    assert problems == []
    settings = HarnessSettings(template="dschat", limit=10)
    scored = []
    for job, (dim, lr) in enumerate([(8, 1e-3), (16, 1e-3), (8, 1e-4), (64, 3e-4)]):
        job_cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, dim=dim))
        job_cfg.optimizer = dataclasses.replace(cfg.optimizer, lr=lr)
        export = run_dir / ("hf_model" if job % 2 else "hf_model-step125")
        evaluation = evaluate(
            export,
            specs,
            settings,
            out_dir=tmp_path / str(job) / "eval",
            cache_dir=tmp_path / "cache",
            builtin=builtin_of(cfg.data, cfg.eval.harness),
            base_cfg=job_cfg,
            title=f"job {job}",
        )
        scored.append(evaluation.base_scored)
        assert "base" in evaluation.record["tasks"][TASK]["acc"]
    assert scored == [[TASK], [], [], []]
    assert len([p for p in (tmp_path / "cache" / "harness-base").iterdir() if p.is_dir()]) == 1


MC_ROWS = [
    ("The capital of France is", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("The capital of Italy is", ["Paris", "Rome", "Berlin", "Madrid"], 1),
    ("Water is made of hydrogen and", ["oxygen", "iron", "gold", "salt"], 0),
    ("The largest planet in the solar system is", ["Mars", "Venus", "Jupiter", "Earth"], 2),
    ("Two plus two equals", ["three", "four", "five", "six"], 1),
    ("The opposite of hot is", ["warm", "cold", "red", "fast"], 1),
]


def qa_task(directory: Path) -> Path:
    """A small multiple-choice task YAML in lm-eval's format, its data a local JSON lines file."""
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in MC_ROWS]
    (directory / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "qa.yaml").write_text(
        f"task: qa\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {directory / 'qa.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: choices\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )
    return directory / "qa.yaml"


def test_smollm2_scores_are_lm_evals_own_with_and_without_its_chat_template(smollm2_dir, tmp_path):
    """SmolLM2-135M-Instruct on a small local task YAML, both ways: the scores and every answer's loglikelihood are
    what lm-eval gives when it is run directly on the same model (with --apply_chat_template, and without)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from ds_exp.evaluation.cli import main

    task_yaml = qa_task(tmp_path)
    lm = HFLM(pretrained=str(smollm2_dir), dtype="auto", batch_size=4, device="cpu")  # lm-eval's own, as its CLI
    for template in (True, False):
        out = tmp_path / f"ours-{template}"
        flags = ["--limit", "4", "--batch-size", "4", "--output", str(out), *([] if template else ["--no-template"])]
        assert main([str(smollm2_dir), str(task_yaml), *flags]) == 0
        ours = json.loads((out / "harness.json").read_text())
        assert ours["settings"]["template"] == ("chat_template" if template else None)
        theirs = lm_eval.simple_evaluate(
            model=lm,
            tasks=[str(task_yaml)],
            task_manager=TaskManager(include_defaults=False),
            limit=4,
            apply_chat_template=template,
            fewshot_as_multiturn=template,
            log_samples=True,
        )
        assert ours["tasks"]["qa"]["acc"]["tuned"] == theirs["results"]["qa"]["acc,none"]
        (samples,) = (out / "tuned" / "qa").glob("samples_qa_*.jsonl")
        mine = {r["doc_id"]: (r["arguments"], r["resps"]) for r in map(json.loads, samples.read_text().splitlines())}
        for sample in theirs["samples"]["qa"]:
            arguments, resps = mine[sample["doc_id"]]
            assert [a["arg_0"] for a in arguments.values()] == [a[0] for a in sample["arguments"]]  # the prompts
            assert [float(r[0][0]) for r in resps] == [float(r[0][0]) for r in sample["resps"]]  # loglikelihoods
        if template:
            assert arguments["gen_args_0"]["arg_0"].startswith("<|im_start|>")  # SmolLM2's chat template
