"""The command line as a user meets it: bad values give one clear message and a non-zero exit before any
heavy work; --help, --cfg job and validation never import torch or deepspeed; the dry run plans without
weights and writes a DeepSpeed config with no "auto" left."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_exp.launch.cli import strip_local_rank
from tests.bad_inputs import Case, run_case_in_process
from tests.conftest import REPO, run_cli


def _json_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD_VALUES = [
    # (overrides, what the message must say)
    (["zero.stage=7"], "zero.stage=7: must be from 0 to 3 (zero=stage0 ... zero=stage3)"),
    (["zero=stage2", "offload=cpu_all"], "offload.param=cpu needs ZeRO stage 3 (got stage 2)"),
    (["offload=cpu"], "offload.optimizer=cpu needs ZeRO stage 1, 2 or 3 (got stage 0)"),
    (["zero=stage3", "offload=nvme"], "offload.optimizer=nvme needs a directory: set offload.nvme_path="),
    (["precision=fp16"], "precision=fp16: the cpu accelerator cannot train in fp16"),
    (["lora.dim=-1"], "lora.dim=-1: must be >= 0"),
    (["train.global_batch_size=30", "train.micro_batch_size=4"], "not a multiple of train.micro_batch_size"),
    (["optimizer.lr=0"], "optimizer.lr=0.0: must be > 0 (the learning rate"),
    (["optimizer.lr=-1e-4"], "optimizer.lr=-0.0001: must be > 0 (the learning rate"),
    (["model=local"], "model.name_or_path is not set and the model has no `arch`: give model.name_or_path="),
    (["model=local", "model.name_or_path=/no/such/model"], "model.name_or_path=/no/such/model: directory not found"),
    (["deepspeed.config_file=/no/such.json"], "deepspeed.config_file=/no/such.json: file not found"),
    (["scheduler.warmup_steps=10", "scheduler.warmup_ratio=0.1"], "are both set: keep one"),
    (["scheduler=polynomial", "scheduler.owner=deepspeed"], "scheduler.name=polynomial has no DeepSpeed equivalent"),
    (["train.micro_batch_size=0"], "train.micro_batch_size=0: must be >= 1"),
    (["train.max_steps=0"], "train.max_steps=0: give a positive number of steps"),
    (["resume=/no/such/checkpoint"], "resume=/no/such/checkpoint: no such checkpoint directory"),
]

# Rejected by the typed schema while Hydra composes: told in one line as every other refusal (exit 2).
SCHEMA_ERRORS = [
    (["zero.stage=three"], "zero.stage"),
    (["zero=stage9"], "zero=stage9: zero has no option stage9; its options: stage0, stage1, stage2, stage3"),
    (["train.not_a_knob=1"], "not_a_knob"),
    (["offload.optimizer=gpu"], "offload.optimizer"),
    (["precision.dtype=fp8"], "precision.dtype"),
    (["dist.launcher=pbs"], "dist.launcher"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_VALUES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_values_give_one_clear_message(tmp_path, overrides, message):
    # through the CLI's main() in this process, as the bad-input catalogue runs what fails before heavy work
    result = run_case_in_process(Case(message, "config value", (*overrides, "dry_run=true"), (message,)), tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert result.stderr.startswith("ds_exp: error:")
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.rglob("ds_config.json"))  # nothing that looks like a planned or finished run


@pytest.mark.parametrize(
    ("overrides", "message"), SCHEMA_ERRORS, ids=lambda v: " ".join(v) if isinstance(v, list) else ""
)
def test_schema_rejects_wrong_types_and_unknown_options(tmp_path, overrides, message):
    result = run_case_in_process(Case(message, "config value", ("--cfg", "job", *overrides), (message,)), tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("ds_exp: error: ") and len(result.stderr.splitlines()) == 1, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_several_problems_are_reported_together(tmp_path):
    result = run_cli("lora.dim=-2", "optimizer.lr=0", "zero.stage=5", "dry_run=true", cwd=tmp_path)
    assert result.returncode == 2
    for message in ("lora.dim=-2", "optimizer.lr=0.0", "zero.stage=5"):
        assert message in result.stderr


def test_config_file_that_is_not_json(tmp_path):
    path = _json_file(tmp_path, "broken.json", '{"train_batch_size": 8,\n  "zero_optimization": {stage: 3}}')
    result = run_cli(f"deepspeed.config_file={path}", "dry_run=true", cwd=tmp_path)
    assert result.returncode == 2
    assert f"deepspeed.config_file={path} is not valid JSON (line 2, column 25" in result.stderr


def test_config_file_with_fp16_and_bf16_both_on(tmp_path):
    path = _json_file(tmp_path, "both.json", json.dumps({"fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    result = run_cli(f"deepspeed.config_file={path}", "dry_run=true", cwd=tmp_path)
    assert result.returncode == 2
    assert "fp16.enabled and bf16.enabled are both true" in result.stderr


def test_full_traceback_on_request(tmp_path):
    result = run_cli("lora.dim=-1", "dry_run=true", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ConfigError" in result.stderr


LIGHT_CHECK = """
import sys
sys.argv = ["ds_exp", *{args!r}]
from ds_exp.launch.cli import main
try:
    main()
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "deepspeed", "transformers", "datasets") if m in sys.modules)
print("HEAVY:", heavy)
"""


@pytest.mark.parametrize(
    "args", [["--help"], ["--cfg", "job"], ["--cfg", "job", "--resolve", "zero=stage3"], ["lora.dim=-1"]]
)
def test_help_cfg_and_validation_import_no_heavy_library(tmp_path, args):
    result = subprocess.run(
        [sys.executable, "-c", LIGHT_CHECK.format(args=args)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert "HEAVY: []" in result.stdout, result.stdout + result.stderr


def test_validation_of_a_valid_config_imports_no_heavy_library(compose_cfg):
    code = """
import sys
from hydra import compose, initialize_config_dir
from ds_exp.config.resolvers import register_resolvers
from ds_exp.config.schema import register_configs, to_config
from ds_exp.launch.validation import validate
from ds_exp.config.paths import conf_dir
register_resolvers(); register_configs()
with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
    cfg = compose("config", overrides=["zero=stage3", "offload=cpu_all", "lora.dim=64", "precision=bf16"])
validate(to_config(cfg))
print("HEAVY:", sorted(m for m in ("torch", "deepspeed", "transformers", "datasets") if m in sys.modules))
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert "HEAVY: []" in result.stdout, result.stdout + result.stderr


def test_dry_run_writes_a_complete_deepspeed_config(tmp_path):
    run_dir = tmp_path / "plan"
    hidden_size_rules = ("zero.reduce_bucket_size=auto", "zero.stage3_param_persistence_threshold=auto")
    result = run_cli(
        "dry_run=true",
        "zero=stage3",
        "precision=bf16",
        "lora.dim=64",
        *hidden_size_rules,
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert "auto" not in json.dumps(ds).replace(str(run_dir), "")
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["train_batch_size"] == 16
    assert ds["zero_optimization"]["reduce_bucket_size"] == 128 * 128  # the tiny model's hidden size
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 1280
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["trainable_parameters"] < plan["parameters"] and plan["lora_targets"] == 14
    assert plan["memory_per_rank"]["device_bytes"] > 0
    assert "ZeRO 3" in result.stdout
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "summary.json").exists()


def test_dry_run_reads_a_local_checkpoint_config_without_weights(tmp_path):
    from transformers import LlamaConfig

    model_dir = tmp_path / "model"
    LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000
    ).save_pretrained(model_dir)  # a config and no weights at all
    run_dir = tmp_path / "plan"
    result = run_cli(
        "dry_run=true",
        "model=local",
        f"model.name_or_path={model_dir}",
        "zero=stage2",
        "zero.reduce_bucket_size=auto",  # Hugging Face's rule: hidden_size^2, from the config alone
        f"model.tokenizer={REPO / 'ds_exp' / 'assets' / 'tokenizer'}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["reduce_bucket_size"] == 256 * 256


def test_hf_style_config_file_resolves_in_a_dry_run(tmp_path):
    path = _json_file(
        tmp_path,
        "zero3.json",
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
                "bf16": {"enabled": "auto"},
                "optimizer": {
                    "type": "AdamW",
                    "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
                },
                "zero_optimization": {
                    "stage": 3,
                    "reduce_bucket_size": "auto",
                    "stage3_prefetch_bucket_size": "auto",
                    "stage3_param_persistence_threshold": "auto",
                },
            }
        ),
    )
    run_dir = tmp_path / "plan"
    result = run_cli(
        "dry_run=true", f"deepspeed.config_file={path}", "precision=bf16", f"hydra.run.dir={run_dir}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3  # the file wins over the default zero=stage0
    assert ds["optimizer"]["params"]["lr"] == 1e-3 and ds["bf16"]["enabled"] is True


def test_strip_local_rank_both_spellings(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "")
    monkeypatch.delenv("LOCAL_RANK")  # recorded by monkeypatch: whatever strip_local_rank sets is undone
    assert strip_local_rank(["prog", "--local_rank=3", "zero=stage3"]) == ["prog", "zero=stage3"]
    import os

    assert os.environ["LOCAL_RANK"] == "3"
    assert strip_local_rank(["prog", "--local-rank", "1", "a=b"]) == ["prog", "a=b"]
    assert os.environ["LOCAL_RANK"] == "3"  # never overwrites what is set


def test_multirun_under_a_multi_rank_launcher_is_refused(tmp_path):
    result = run_cli("-m", "zero=stage0,stage1", cwd=tmp_path, env={"RANK": "0", "WORLD_SIZE": "2"})
    assert result.returncode != 0
    assert "use a submitit launcher with several tasks per node" in result.stderr


def test_zero_sweep_composes_four_jobs(tmp_path):
    """`-m experiment=zero_sweep` runs one job per ZeRO stage (as dry runs here: quick, no engine)."""
    result = run_cli(
        "-m", "experiment=zero_sweep", "dry_run=true", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    stages = sorted(
        json.loads(path.read_text())["zero_optimization"]["stage"]
        for path in (tmp_path / "sweep").glob("*/ds_config.json")
    )
    assert stages == [0, 1, 2, 3]


def test_wheel_ships_conf_and_assets(tmp_path):
    """After a non-editable install the package finds conf/ (shipped as ds_exp/conf) and its tokenizer."""
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("ds_exp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "ds_exp/conf/config.yaml",
        "ds_exp/conf/zero/stage3.yaml",
        "ds_exp/conf/experiment/dschat_step1.yaml",
        "ds_exp/assets/tokenizer/tokenizer.json",
        "ds_exp/launch/cli.py",
    ):
        assert expected in names
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    code = "from ds_exp.config.paths import conf_dir; print(conf_dir())"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site)}, capture_output=True, text=True
    )
    assert out.stdout.strip() == str(site / "ds_exp" / "conf"), out.stderr


def test_console_script(tmp_path):
    import shutil

    script = shutil.which("ds-exp")
    if script is None:
        pytest.skip("ds_exp is not installed (pip install -e .) so there is no ds-exp script")
    result = subprocess.run([script, "--cfg", "job", "zero=stage2"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "stage: 2" in result.stdout


def test_a_sweep_with_one_bad_combination_is_refused_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli("-m", "zero=stage2,stage3", "offload=cpu_all", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 2
    assert "the sweep was not started: 1 problem(s) in its 2 jobs" in result.stderr
    assert "job [zero=stage2 offload=cpu_all]: offload.param=cpu needs ZeRO stage 3" in result.stderr
    assert not sweep.exists()  # no job ran


def test_max_seq_len_beyond_a_rotary_context_is_warned_once_at_run_start(tmp_path):
    """The tiny default is Llama (RoPE, 512 positions): a longer data.max_seq_len trains, with one warning."""
    expected = "data.max_seq_len=1024 is beyond the model's trained context (max_position_embeddings=512)"
    run_dir = tmp_path / "run"
    result = run_cli(
        "data.max_seq_len=1024",
        "train.max_steps=1",
        "train.eval_at_start=false",
        "train.save_final_checkpoint=false",
        "train.export=false",
        "train.micro_batch_size=4",
        "data.synthetic.num_train=64",
        "data.synthetic.num_eval=8",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "logs" / "rank0.log").read_text().count(expected) == 1
    plan = run_cli("dry_run=true", "data.max_seq_len=1024", f"hydra.run.dir={tmp_path / 'plan'}", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert f"  note       {expected}" in plan.stdout


def test_the_sweep_report_names_damaged_job_files_and_reports_the_rest(tmp_path, capsys):
    from ds_exp.sweeps import runs

    good = {"status": "completed", "world_size": 1, "tokens_per_s": 1000.0, "final_eval": {"perplexity": 3.5}}
    jobs = {
        "0": ("- train.max_steps=2\n", json.dumps(good)),
        "1": ("- train.max_steps=3\n", '{"status": "compl'),  # cut short
        "2": ("- [a\n", json.dumps(good)),  # not YAML
        "3": ("- train.max_steps=5\n", "[1, 2]"),  # JSON, not a summary
        "4": ("- train.max_steps=6\n", json.dumps({**good, "tokens_per_s": "fast"})),
    }
    for name, (overrides, summary) in jobs.items():
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(overrides)
        (tmp_path / name / "summary.json").write_text(summary)
    (tmp_path / "autotune.json").write_text("{")  # an autotune sweep's plan, damaged: its ranking is left out
    assert runs.main([str(tmp_path)]) == 1  # not every job completed
    err = capsys.readouterr().err
    rows = {row["job"]: row for row in csv.DictReader((tmp_path / "report.csv").open())}
    assert rows["0"]["status"] == "completed" and rows["0"]["perplexity"] == "3.5"
    assert rows["1"]["status"] == "damaged" and "summary.json is damaged: not valid JSON (line 1" in rows["1"]["error"]
    assert rows["2"]["status"] == "completed" and "overrides.yaml is damaged: not valid YAML" in rows["2"]["error"]
    assert "summary.json is damaged: a JSON list, not the object a run writes" in rows["3"]["error"]
    assert "summary.json is damaged: tokens_per_s is not a number" in rows["4"]["error"]
    for job in "1234":
        assert f"ds_exp: warning: job {job}: {tmp_path / job}" in err
    assert "the autotune ranking is left out: a record of it in" in err
    assert (tmp_path / "report.md").is_file() and (tmp_path / "report.png").is_file()


def test_parity_out_naming_a_file_is_one_message(tmp_path, capsys):
    from ds_exp.tools.parity.cli import main

    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    for out, expected in (
        (afile, f"ds_exp: error: --out {afile}: is a file; parity writes its two runs into a directory"),
        (afile / "sub", f"ds_exp: error: --out {afile / 'sub'}: {afile} is a file, not a directory; point --out at"),
    ):
        assert main(["--steps", "2", "--out", str(out), "zero=stage0", "--", "zero=stage1"]) == 2
        assert capsys.readouterr().err.startswith(expected)
    assert afile.read_text() == "mine\n"
