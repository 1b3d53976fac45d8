"""Correctness of real DeepSpeed training on CPU (fp32): stage, accumulation and world-size equivalence,
exact resume, exports that reload, launchers, wandb offline files. Where no process boundary is under test the
recipe runs in the test's process through the Python API (tests/training.py train_here)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.console import MACHINE_STATE, PROGRESS, readme_console, shape
from tests.training import FAST, REPO, Run, assert_close, launch, multirun, report_rows, train_here, user_env
from tests.wandb_files import history

pytestmark = pytest.mark.slow


# The full fine-tune trains with DeepSpeed's Muon (its auxiliary AdamW for the embedding and the norms), whose ZeRO
# 1-3 code splits each matrix's update over the ranks; LoRA with AdamW. Muon at ZeRO 1-3 needs gradient clipping off.
OPTIMIZER_OF = {0: ("optimizer=muon", "train.gradient_clipping=0"), 8: ("optimizer=adamw",)}


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, cache_dir):
    """The same 2-rank run at every ZeRO stage, with and without LoRA (shared by several tests)."""
    root = tmp_path_factory.mktemp("zero")
    runs = {}
    for lora in (0, 8):
        for stage in range(4):
            run = launch(
                root / f"stage{stage}_lora{lora}",
                *FAST,
                f"zero=stage{stage}",
                f"lora.dim={lora}",
                *OPTIMIZER_OF[lora],
                "train.export=true",
                launcher="ranks",
                nproc=2,
                cache_dir=cache_dir,
            )
            assert run.ok, run.explain()
            runs[stage, lora] = run
    return runs


@pytest.mark.parametrize("lora", [0, 8], ids=["full-muon", "lora-adamw"])
def test_losses_equal_across_zero_stages(zero_runs, lora):
    reference = zero_runs[0, lora].losses
    assert len(reference) == 8
    assert reference[-1] < reference[0]  # it trains
    for stage in (1, 2, 3):
        assert_close(zero_runs[stage, lora].losses, reference)
    assert zero_runs[3, lora].summary["zero_stage"] == 3


def test_zero3_export_holds_every_weight(zero_runs):
    full = load_file(zero_runs[0, 0].run_dir / "hf_model" / "model.safetensors")
    sharded = load_file(zero_runs[3, 0].run_dir / "hf_model" / "model.safetensors")
    assert full.keys() == sharded.keys() and full
    for name, tensor in full.items():
        assert sharded[name].numel() > 0 and sharded[name].shape == tensor.shape, name
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-3, atol=1e-4, msg=name)


def test_lora_export_is_merged(zero_runs):
    weights = load_file(zero_runs[3, 8].run_dir / "hf_model" / "model.safetensors")
    assert not [k for k in weights if "lora" in k]
    assert zero_runs[3, 8].summary["trainable_parameters"] < zero_runs[3, 0].summary["trainable_parameters"]


@pytest.mark.parametrize(("micro", "accumulation"), [(2, 2), (1, 4)])
def test_gradient_accumulation_equivalence(tmp_path, cache_dir, micro, accumulation):
    reference = train_here(tmp_path / "m4", *FAST, cache_dir=cache_dir)
    assert reference.ok, reference.explain()
    run = train_here(
        tmp_path / f"m{micro}x{accumulation}",
        *FAST,
        f"train.micro_batch_size={micro}",
        f"train.gradient_accumulation_steps={accumulation}",
        cache_dir=cache_dir,
    )
    assert run.ok, run.explain()
    assert_close(run.losses, reference.losses)


def test_the_python_api_runs_the_recipe_here_as_the_command_line_does(tmp_path, cache_dir, monkeypatch):
    """`from ds_exp import train; summary = train([...])` (issue 35 §9): the command line's run directory (.hydra/,
    ds_exp.log, logs/, metrics.jsonl, plots/loss.png drawn at an evaluation and at the end), its summary.json
    returned, and the process as it was: no process group, Hydra's state, logging handlers, launch variables and the
    libraries' progress bars put back, so a second call trains again (another ZeRO stage, from a thread)."""
    import asyncio
    import logging

    import datasets
    import torch.distributed as dist
    import transformers
    from hydra.core.global_hydra import GlobalHydra

    from ds_exp import train

    monkeypatch.chdir(tmp_path)  # outputs/<experiment_name>/<time>/ lands here, as on the command line
    handlers = logging.getLogger().handlers[:]
    datasets.enable_progress_bars()  # a notebook's (the libraries' defaults), which the run's console turns off
    transformers.utils.logging.enable_progress_bar()
    overrides = [*FAST, "train.eval_every=4", f"data.cache_dir={cache_dir}", "experiment_name=api"]
    summary = train(overrides)
    (run_dir,) = (tmp_path / "outputs" / "api").iterdir()
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["launcher"], summary["overrides"]) == (
        "completed", 8, "single", overrides
    )  # fmt: skip
    for name in (".hydra/config.yaml", ".hydra/overrides.yaml", "ds_exp.log", "logs/rank0.log", "metrics.jsonl"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "plots" / "loss.png").read_bytes().startswith(b"\x89PNG")
    drawn = [line for line in (run_dir / "logs" / "rank0.log").read_text().splitlines() if "loss.png drawn" in line]
    assert len(drawn) >= 2  # the evaluation at step 4, and the end (the one at step 8 may come too soon after)
    assert not dist.is_initialized() and not GlobalHydra.instance().is_initialized()
    assert logging.getLogger().handlers == handlers and "RANK" not in os.environ
    assert datasets.is_progress_bar_enabled() and transformers.utils.logging.is_progress_bar_enabled()
    # off the main thread (a notebook's `await asyncio.to_thread(train, ...)`), where Python takes no signal
    # handler: the run trains without them, says so, and lets its run directory go (issue 39 §6)
    second = [*FAST, "train.max_steps=2", "zero=stage2", f"data.cache_dir={cache_dir}", "experiment_name=api2"]
    again = asyncio.run(asyncio.to_thread(train, second))
    assert (again["status"], again["steps"], again["zero_stage"]) == ("completed", 2, 2)
    (run_dir,) = (tmp_path / "outputs" / "api2").iterdir()
    assert "not on the process's main thread" in (run_dir / "ds_exp.log").read_text()
    assert not (run_dir / ".ds_exp.lock").exists()


def test_world_size_equivalence(tmp_path, cache_dir):
    one = train_here(tmp_path / "one", *FAST, cache_dir=cache_dir)
    two = launch(tmp_path / "two", *FAST, "train.micro_batch_size=2", launcher="ranks", nproc=2, cache_dir=cache_dir)
    assert one.ok, one.explain()
    assert two.ok, two.explain()
    assert two.summary["world_size"] == 2
    assert_close(two.losses, one.losses)


def test_resume_continues_exactly(tmp_path, cache_dir):
    common = [*FAST, "train.save_every=4", "train.save_final_checkpoint=true", "train.export=true"]
    straight = train_here(tmp_path / "straight", *common, cache_dir=cache_dir)
    assert straight.ok, straight.explain()
    resumed = train_here(
        tmp_path / "resumed", *common, f"resume={straight.run_dir / 'checkpoints' / 'step4'}", cache_dir=cache_dir
    )
    assert resumed.ok, resumed.explain()
    assert [r["step"] for r in resumed.records("train")] == [5, 6, 7, 8]
    assert_close(resumed.losses, straight.losses[4:], rel=1e-6)
    a = load_file(straight.run_dir / "hf_model" / "model.safetensors")
    b = load_file(resumed.run_dir / "hf_model" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)


def test_resume_auto_picks_the_newest_complete_checkpoint(tmp_path, cache_dir):
    common = [*FAST, "train.save_every=4", "train.save_final_checkpoint=false", "train.max_steps=4"]
    first = train_here(tmp_path / "run", *common, cache_dir=cache_dir)
    assert first.ok, first.explain()
    # a torn save: the directory of a later step without the completeness marker must be ignored
    (first.run_dir / "checkpoints" / "step6").mkdir()
    again = train_here(tmp_path / "run", *FAST, "train.save_every=4", "resume=auto", cache_dir=cache_dir)
    assert again.ok, again.explain()
    assert again.summary["resumed_from"].endswith("step4")
    assert [r["step"] for r in again.records("train")][-4:] == [5, 6, 7, 8]
    # the final line counts this attempt's steps, which its time is of (issue 41 §10)
    final = again.proc.stdout.splitlines()[-1]
    assert final.startswith("ds_exp: completed 4 steps (5-8, resumed at step 4) in "), final


def test_resume_from_a_directory_without_checkpoints_is_an_error(tmp_path, cache_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = train_here(tmp_path / "run", *FAST, f"resume={empty}", cache_dir=cache_dir)
    assert run.proc.returncode != 0
    assert f"resume={empty}: no complete checkpoint in {empty}" in run.proc.stderr
    assert "Traceback" not in run.proc.stderr


def test_exported_model_reloads_with_the_engines_eval_loss(tmp_path, cache_dir, compose_cfg):
    from transformers import AutoModelForCausalLM

    from ds_exp.data.pipeline import prepare_sft_data
    from ds_exp.model.tokenizer import load_tokenizer
    from ds_exp.train.collate import make_collator
    from ds_exp.train.step import token_loss_sum

    run = train_here(tmp_path / "run", *FAST, "train.export=true", "lora.dim=8", cache_dir=cache_dir)
    assert run.ok, run.explain()
    model = AutoModelForCausalLM.from_pretrained(run.run_dir / "hf_model").eval()
    cfg = compose_cfg(*FAST, f"data.cache_dir={cache_dir}")
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    eval_set = prepare_sft_data(cfg.data, tokenizer, seed=cfg.train.seed).eval
    collate = make_collator(tokenizer)
    total = tokens = 0.0
    with torch.no_grad():
        for start in range(0, len(eval_set), 8):
            batch = collate([eval_set[i] for i in range(start, min(start + 8, len(eval_set)))])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss, count = token_loss_sum(logits, batch["labels"])
            total, tokens = total + float(loss), tokens + float(count)
    assert math.isclose(total / tokens, run.summary["final_eval"]["eval_loss"], rel_tol=1e-4)
    assert (run.run_dir / "hf_model_adapter" / "adapter_config.json").is_file()  # with LoRA, unasked (issue 35 §4)


def test_merged_lora_export_equals_the_adapter_model(tmp_path, cache_dir, compose_cfg):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ds_exp.model.build import build_model
    from ds_exp.model.tokenizer import load_tokenizer

    run = train_here(tmp_path / "run", *FAST, "train.export=true", "lora.dim=8", cache_dir=cache_dir)
    assert run.ok, run.explain()
    merged = AutoModelForCausalLM.from_pretrained(run.run_dir / "hf_model").eval()
    # only the adapters trained, so the base under them is the initial model, rebuilt from the same seed
    cfg = compose_cfg()
    base = build_model(cfg, load_tokenizer(cfg.model, cfg.data), {"zero_optimization": {"stage": 0}}).model
    adapter = PeftModel.from_pretrained(base, run.run_dir / "hf_model_adapter").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapter(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_padding_never_changes_the_loss(compose_cfg):
    from ds_exp.model.build import build_model
    from ds_exp.model.tokenizer import load_tokenizer
    from ds_exp.train.step import IGNORE_INDEX, token_loss_sum

    cfg = compose_cfg()
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    model = build_model(cfg, tokenizer, {"zero_optimization": {"stage": 0}}).model.eval()
    ids = torch.tensor([tokenizer(" Human: copy a b Assistant: a b")["input_ids"]])
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX
    pad = torch.full((1, 9), tokenizer.pad_token_id)
    padded_ids = torch.cat([ids, pad], dim=1)
    padded_labels = torch.cat([labels, torch.full_like(pad, IGNORE_INDEX)], dim=1)
    mask = torch.cat([torch.ones_like(ids), torch.zeros_like(pad)], dim=1)
    with torch.no_grad():
        plain = token_loss_sum(model(input_ids=ids).logits, labels)
        padded = token_loss_sum(model(input_ids=padded_ids, attention_mask=mask).logits, padded_labels)
    assert int(plain[1]) == int(padded[1])
    torch.testing.assert_close(padded[0], plain[0], rtol=1e-5, atol=1e-5)


# Imported at start-up by every Python process of a launch (on its PYTHONPATH): as each training rank's last act
# before the interpreter shuts down, it writes down the threads it still has.
THREAD_PROBE = """
import atexit, os, sys

def _threads_at_shutdown():
    if "ds_exp.train" in sys.modules:  # a training rank, not the launcher's own process
        task = f"/proc/{os.getpid()}/task"
        names = [open(f"{task}/{t}/comm").read().strip() for t in os.listdir(task)]
        with open(os.path.join(os.path.dirname(__file__), f"threads-{os.getpid()}.txt"), "w") as fh:
            fh.write("\\n".join(names))

atexit.register(_threads_at_shutdown)  # registered first: runs last
"""


@pytest.mark.parametrize("launcher", ["single", "torchrun", "deepspeed", "mpirun"])
def test_launchers_train_the_user_command(tmp_path, cache_dir, launcher):
    """`python -m ds_exp zero=stage3 precision=bf16 lora.dim=64` under every launcher: one run directory
    with checkpoints, metrics, summary, an export and one log file per rank. No rank reaches the interpreter's
    shutdown with gloo's threads still running (freed then, they aborted a completed rank now and then: SIGABRT,
    "terminate called without an active exception"). Under each multi-rank launcher the run is DeepSpeed-Chat's
    step 2: objective=dpo, the reference the same weights with the adapters off, on both ranks (issue 40)."""
    nproc = 1 if launcher == "single" else 2
    dpo = ["objective=dpo"] if nproc > 1 else []
    env = None
    probe = tmp_path / "probe"
    if launcher != "single":  # (a single run forks from the test zygote, which a start-up module never sees)
        probe.mkdir()
        (probe / "sitecustomize.py").write_text(THREAD_PROBE)
        env = {"PYTHONPATH": f"{REPO}{os.pathsep}{probe}"}
    run = launch(
        tmp_path / "outputs" / "run",
        *FAST,
        "zero=stage3",
        "precision=bf16",
        "lora.dim=64",
        "train.max_steps=4",
        "train.save_final_checkpoint=true",
        "train.export=true",
        *dpo,
        launcher=launcher,
        nproc=nproc,
        cache_dir=cache_dir,
        cwd=tmp_path,
        env=env,
    )
    assert run.ok, run.explain()
    if launcher != "single":
        threads = [path.read_text().split() for path in probe.glob("threads-*.txt")]
        assert len(threads) == nproc and threads[0], threads
        assert not [name for names in threads for name in names if "gloo" in name], threads
    summary = run.summary
    assert summary["status"] == "completed" and summary["world_size"] == nproc
    assert summary["launcher"] == {"single": "single", "torchrun": "env", "deepspeed": "env", "mpirun": "mpi"}[launcher]
    # what a person comparing runs needs (issue 35 §12): the rows, the batch, the peak rate and the command line
    assert summary["train_examples"] == 256 and summary["global_batch_size"] == 4 * nproc
    assert summary["peak_lr"] == 1e-3 and summary["overrides"][: len(FAST) + 1] == [*FAST, "zero=stage3"]
    assert sorted(p.name for p in (run.run_dir / "logs").iterdir()) == [f"rank{r}.log" for r in range(nproc)]
    assert (run.run_dir / "checkpoints" / "step4" / "ds_exp_complete.json").is_file()
    assert (run.run_dir / "hf_model" / "model.safetensors").is_file()
    assert len(run.records("train")) == 4
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["run"]  # no directory per rank
    ds_config = json.loads((run.run_dir / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 3 and ds_config["bf16"]["enabled"] is True
    # the console under each launcher (issue 35 §5): ds_exp's lines once (rank 0's), what the user asked for, the
    # final line last; no torchrun banner. The DeepSpeed launcher's own import-time notice is all that is not ours.
    said = [line for line in run.proc.stdout.splitlines() if "real_accelerator.py" not in line]
    assert all(line.startswith("ds_exp: ") for line in said), run.proc.stdout
    assert "OMP_NUM_THREADS" not in run.proc.stdout + run.proc.stderr
    assert [line for line in said if line.startswith("ds_exp: training: ")] == [
        "ds_exp: training: ZeRO stage 3, bf16, no offload, LoRA rank 64, alpha 64"
    ]
    assert said[-1].startswith("ds_exp: completed 4 steps in ") and said.count(said[-1]) == 1
    if dpo:  # the step-1 policy is the reference (LoRA's B starts at zero), then the rewards move apart
        lines = run.records("train")
        assert lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and lines[0]["reward_margin"] == 0, lines
        assert all(line["rewards_chosen"] != line["rewards_rejected"] for line in lines[1:]), lines
        final = summary["final_eval"]
        assert final["eval_pairs"] == 32 and 0 <= final["reward_accuracy"] <= 1 and math.isfinite(final["eval_loss"])
        assert "ds_exp: DPO reference: the starting model, the same weights with the LoRA adapters off" in said, said


def test_wandb_offline_files_hold_the_metrics(tmp_path, cache_dir):
    with contextlib.chdir(tmp_path):  # where the run is started: the console names its wandb files from there
        run = train_here(
            tmp_path / "run",
            *FAST,
            "logger=wandb",
            "logger.wandb.mode=offline",
            cache_dir=cache_dir,
            env={"WANDB_MODE": "offline"},
        )
    assert run.ok, run.explain()
    (run_file,) = (run.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's own lines stay off the console (its run history came after the final line): ds_exp says where it is
    console = (run.proc.stdout + run.proc.stderr).splitlines()
    assert [line for line in console if line.startswith("wandb:")] == [], console
    where = run_file.parent.relative_to(tmp_path)  # from where the run was started
    assert f"ds_exp: wandb: an offline run; upload it with: wandb sync {where}" in console
    assert run.proc.stdout.splitlines()[-1].startswith("ds_exp: completed 8 steps in ")
    logged = history(run_file)
    for record in run.records("train"):
        assert math.isclose(logged[record["step"]]["train/loss"], record["loss"], rel_tol=1e-6)
    final = run.records("eval")[-1]
    assert math.isclose(logged[final["step"]]["eval/perplexity"], final["perplexity"], rel_tol=1e-6)


def test_generations_before_and_after_under_zero3_reach_the_file_and_wandb(tmp_path, cache_dir):
    prompts = ["reverse the words: cat dog", "sort the digits: 3 1 2"]
    run = launch(
        tmp_path / "run",
        *FAST,
        "zero=stage3",  # every forward is a collective: both ranks generate, rank 0 writes
        f"eval.prompts=[{','.join(repr(p) for p in prompts)}]",
        "eval.max_new_tokens=6",
        "logger=wandb",
        "logger.wandb.mode=offline",
        launcher="ranks",
        nproc=2,
        cache_dir=cache_dir,
        env={"WANDB_MODE": "offline"},
    )
    assert run.ok, run.explain()
    lines = [json.loads(line) for line in (run.run_dir / "generations.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in lines] == [(0, p) for p in prompts] + [(8, p) for p in prompts]
    assert all(isinstance(r["completion"], str) for r in lines)
    (run_file,) = (run.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    tables = {step: items for step, items in history(run_file).items() if "eval/generations/path" in items}
    assert sorted(tables) == [0, 8]
    for step, items in tables.items():
        table = json.loads((run_file.parent / "files" / items["eval/generations/path"]).read_text())
        assert table["columns"] == ["step", "prompt", "completion"]
        assert table["data"] == [[r["step"], r["prompt"], r["completion"]] for r in lines if r["step"] == step]


def test_the_default_run_piped_prints_the_readmes_lines(tmp_path, cache_dir):
    """`python -m ds_exp` on its embedded defaults, piped: it learns (its harness run,
    tests/integration/test_harness.py, scores it), and says what the README shows."""
    run = launch(tmp_path / "run", cache_dir=cache_dir)
    assert run.ok, run.explain()
    summary = run.summary
    assert summary["final_eval"]["perplexity"] < 0.05 * summary["initial_eval"]["perplexity"]
    assert summary["final_eval"]["perplexity"] < 10
    # piped (issue 35 §5): no bar frames, a plain progress line every tenth, and otherwise the README's lines
    assert "\r" not in run.proc.stdout + run.proc.stderr and "%|" not in run.proc.stdout + run.proc.stderr
    lines = run.proc.stdout.splitlines()
    progress = [line for line in lines if PROGRESS.match(line)]
    assert [int(line.split()[2].split("/")[0]) for line in progress] == list(range(25, 251, 25)), progress
    extra = (*MACHINE_STATE, "Tokenizing ", "train: ")  # a first run's compile, the terminal's bars
    said = [shape(line) for line in lines if not PROGRESS.match(line) and not line.startswith(extra)]
    assert said == [shape(line) for line in readme_console() if not line.startswith(extra)], run.proc.stdout
    times = summary["time_s"]  # the final line's parts, kept (issue 35 §6)
    assert sum(times[k] for k in ("compile", "load", "train", "evaluate_and_save")) == pytest.approx(times["total"])
    assert times["train"] > 0 and times["load"] > 0 and times["total"] == summary["wall_time_s"]


def test_gradient_checkpointing_with_lora_gives_the_same_losses(tmp_path, cache_dir):
    plain = train_here(tmp_path / "plain", *FAST, "lora.dim=8", cache_dir=cache_dir)
    checkpointed = train_here(
        tmp_path / "ckpt", *FAST, "lora.dim=8", "model.gradient_checkpointing=true", cache_dir=cache_dir
    )
    assert plain.ok, plain.explain()
    assert checkpointed.ok, checkpointed.explain()
    assert_close(checkpointed.losses, plain.losses)


def test_optimizer_offload_uses_cpu_adam_with_the_same_losses(tmp_path, cache_dir):
    reference = train_here(tmp_path / "ref", *FAST, "zero=stage2", cache_dir=cache_dir)
    offloaded = train_here(tmp_path / "off", *FAST, "zero=stage2", "offload=cpu", cache_dir=cache_dir)
    assert reference.ok, reference.explain()
    assert offloaded.ok, offloaded.explain()
    assert "DeepSpeedCPUAdam" in (offloaded.run_dir / "logs" / "rank0.log").read_text()
    assert_close(offloaded.losses, reference.losses, rel=1e-3)


def test_lora_scope_that_matches_nothing_lists_the_candidates(tmp_path, cache_dir):
    run = train_here(tmp_path / "run", *FAST, "lora.dim=8", "lora.module_name=decoder.layers.", cache_dir=cache_dir)
    assert run.proc.returncode == 2
    assert "lora.module_name=decoder.layers. matches no Linear layer" in run.proc.stderr
    assert "model.layers.0.self_attn." in run.proc.stderr
    assert "Traceback" not in run.proc.stderr
    assert not run.run_dir.exists()  # refused before any work: no stub of a run (issue 35 §8)


def test_multirun_in_one_process_runs_every_job(tmp_path, cache_dir):
    """The basic launcher runs jobs one after another in one process: each gets a clean process group."""
    sweep = tmp_path / "sweep"
    proc = multirun(tmp_path, sweep, "zero=stage0,stage2", *FAST, "train.max_steps=2", f"data.cache_dir={cache_dir}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert [s["zero_stage"] for s in summaries] == [0, 2]
    assert all(s["status"] == "completed" for s in summaries)
    # its console: Hydra's lines and each job's as ds_exp says them, each job ending on its final line, the report
    said = proc.stdout.split("ds_exp sweep report (")[0].splitlines()
    assert all(line.startswith("ds_exp: ") for line in said), proc.stdout
    jobs = [line.split(" train.")[0] for line in said if line.startswith("ds_exp: #")]
    assert jobs == ["ds_exp: #0 : zero=stage0", "ds_exp: #1 : zero=stage2"], said
    assert said[-1].startswith("ds_exp: completed 2 steps in ")
    # the sweep report, written at the end of the multirun and again on demand
    rows = report_rows(sweep)
    assert [(r["zero_stage"], r["status"]) for r in rows] == [("0", "completed"), ("2", "completed")]
    assert all(float(r["tokens_per_s"]) > 0 and float(r["peak_memory_mib"]) > 0 for r in rows)
    assert (sweep / "report.png").stat().st_size > 10_000 and "| zero=stage0" in (sweep / "report.md").read_text()
    again = subprocess.run(
        [sys.executable, "-m", "ds_exp.report", str(sweep)],
        capture_output=True,
        text=True,
        env=user_env(),
    )
    assert again.returncode == 0 and "zero=stage2" in again.stdout


OPTIMIZERS_HERE = ["adam", "lion", "sgd", "adafactor", "muon"]  # adamw: test_resume_continues_exactly


def test_every_optimizer_learns_and_resumes_exactly(tmp_path, cache_dir):
    """`-m optimizer=...` is a sweep like any other: every optimizer trains from its YAML's defaults in one process,
    saving at step 2; the same sweep with resume=auto, its step-4 checkpoints gone, continues each job from step 2
    with its optimizer's state, and steps 3-4 are the uninterrupted run's, bit for bit (ZeRO stage 0: the one
    every optimizer runs at; Muon across ZeRO 0-3 on 2 ranks is zero_runs')."""
    sweep = tmp_path / "sweep"
    common = [f"optimizer={','.join(OPTIMIZERS_HERE)}", *FAST, "train.max_steps=4", "train.save_every=2"]
    first = multirun(tmp_path, sweep, *common, f"data.cache_dir={cache_dir}")
    assert first.returncode == 0, first.stderr[-4000:]
    jobs = [sweep / str(number) for number in range(len(OPTIMIZERS_HERE))]
    straight = {}
    for name, job in zip(OPTIMIZERS_HERE, jobs, strict=True):
        assert json.loads((job / "summary.json").read_text())["optimizer"].startswith(_built_as(name)), name
        straight[name] = Run(first, job).losses
        assert straight[name][-1] < straight[name][0], (name, straight[name])
        shutil.rmtree(job / "checkpoints" / "step4")
        (job / "checkpoints" / "latest").write_text("step2")
    again = multirun(tmp_path, sweep, *common, "resume=auto", f"data.cache_dir={cache_dir}")
    assert again.returncode == 0, again.stderr[-4000:]
    for name, job in zip(OPTIMIZERS_HERE, jobs, strict=True):
        resumed = Run(again, job)
        assert resumed.summary["resumed_from"].endswith("step2"), name
        assert [r["step"] for r in resumed.records("train")] == [1, 2, 3, 4]  # steps 3-4 again; the first ones aside
        assert resumed.losses[2:] == straight[name][2:], name


def _built_as(name: str) -> str:
    """What summary.json says updates the weights (ds_exp/model/engine.py: describe_optimizer)."""
    return {"adam": "Adam", "lion": "Lion", "sgd": "SGD", "adafactor": "Adafactor", "muon": "muon (built by"}[name]


def test_a_failed_sweep_job_is_reported_and_the_sweep_goes_on(tmp_path, cache_dir):
    sweep = tmp_path / "sweep"
    proc = multirun(
        tmp_path,
        sweep,
        "lora.module_name=nomatch.,layers.",
        "lora.dim=4",
        *FAST,
        "train.max_steps=2",
        f"data.cache_dir={cache_dir}",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "1 of 2 sweep jobs did not complete" in proc.stderr
    rows = report_rows(sweep)
    assert [r["status"] for r in rows] == ["failed", "completed"]
    assert "matches no Linear layer" in rows[0]["error"]


def test_local_checkpoint_trains_and_its_vocabulary_is_padded(tmp_path, cache_dir):
    """model=local model.name_or_path=<dir>: weights and tokenizer come from a Hugging Face directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "checkpoint"
    tokenizer = AutoTokenizer.from_pretrained(REPO / "ds_exp" / "assets" / "tokenizer")
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=len(tokenizer) - 3
    )  # smaller than the tokenizer and not a multiple of 8
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    run = launch(
        tmp_path / "run",
        *FAST,
        "model=local",
        f"model.name_or_path={model_dir}",
        "train.export=true",
        "zero=stage3",
        launcher="ranks",
        nproc=2,
        cache_dir=cache_dir,
    )
    assert run.ok, run.explain()
    assert run.losses[-1] < run.losses[0]
    exported = json.loads((run.run_dir / "hf_model" / "config.json").read_text())
    assert exported["vocab_size"] == len(tokenizer) and exported["vocab_size"] % 8 == 0


def test_deepspeed_can_own_optimizer_and_scheduler(tmp_path, cache_dir):
    # torch_adam: DeepSpeed's AdamW on torch's kernel; its FusedAdam takes minutes to compile on a CPU (CI timed out)
    torch_adam = tmp_path / "torch_adam.json"
    torch_adam.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}))
    run = train_here(
        tmp_path / "run",
        *FAST,
        f"deepspeed.config_file={torch_adam}",
        "optimizer.owner=deepspeed",
        "scheduler.owner=deepspeed",
        "scheduler=constant",
        "zero=stage2",
        cache_dir=cache_dir,
    )
    assert run.ok, run.explain()
    ds_config = json.loads((run.run_dir / "ds_config.json").read_text())
    assert ds_config["optimizer"]["params"]["lr"] == 1e-3 and ds_config["scheduler"]["type"] == "WarmupLR"
    assert "DeepSpeed using configured LR scheduler = WarmupLR" in (run.run_dir / "logs" / "rank0.log").read_text()
    assert {r["lr"] for r in run.records("train")} == {1e-3}
    assert run.losses[-1] < run.losses[0]


def test_packed_training_learns(tmp_path, cache_dir):
    run = train_here(tmp_path / "run", *FAST, "data.packing=true", "train.eval_at_start=true", cache_dir=cache_dir)
    assert run.ok, run.explain()
    evals = run.records("eval")
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
