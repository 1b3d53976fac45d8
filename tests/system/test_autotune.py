"""experiment=autotune end to end on CPU: candidates refused by validation or ruled out by the memory estimate are
listed and never launched, a probe that really runs out of memory is recorded and the sweep goes on, the report
ranks what fits and its command line trains with the winner. Locally (Hydra's basic launcher) and as SLURM jobs of
2 ranks each.

The out-of-memory is real: the local probes run under an RLIMIT_DATA (set on the sweep's process), so the big micro
batch's allocation fails in torch's CPU allocator, as it would on a smaller machine.
"""

from __future__ import annotations

import csv
import json
import resource
import shlex
import subprocess
import sys

import pytest

from tests.conftest import run_cli
from tests.system.test_slurm import slurm  # noqa: F401  (the fixture)
from tests.training import user_env

DATA_LIMIT = 1_500_000_000  # bytes of data segment per process: micro batch 2 fits, 1024 does not
GRID = [
    "experiment=autotune",
    "hydra.sweeper.memory_budget=4GiB",  # rules out micro batch 8192 (~14 GiB estimated), keeps 1024 (~1.8 GiB)
    "model.gradient_checkpointing=false",
    "train.max_steps=3",
    "data.synthetic.num_eval=16",
]


def autotune(tmp_path, *overrides, limit_data: bool, timeout: float = 900) -> subprocess.CompletedProcess:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (DATA_LIMIT, DATA_LIMIT))

    return subprocess.run(
        [sys.executable, "-m", "ds_exp", "-m", *GRID, *overrides, f"data.cache_dir={tmp_path / 'cache'}"],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=cap if limit_data else None,
    )


def ranking(sweep_dir) -> dict[str, dict[str, str]]:
    with (sweep_dir / "autotune.csv").open() as fh:
        return {row["candidate"]: row for row in csv.DictReader(fh)}


def recommended_command(stdout: str) -> list[str]:
    line = stdout.split("Train with it:", 1)[1].strip().splitlines()[0]
    return shlex.split(line)


def check_dry_run_of(command: list[str], tmp_path, expected: dict[str, int]) -> None:
    """The printed command, as the user would paste it (as a dry run here), composes the winner's configuration."""
    assert command[:3] == ["python", "-m", "ds_exp"], command
    args = [a for a in command[3:] if a != "-m" and not a.startswith(("hydra/launcher=", "hydra.launcher."))]
    assert not [a for a in args if a.startswith(("experiment=", "train.max_steps", "train.export"))], args
    run_dir = tmp_path / "winner"
    proc = run_cli(*args, "dry_run=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    assert plan["zero_stage"] == expected["zero_stage"]
    assert ds_config["train_micro_batch_size_per_gpu"] == expected["micro"]


@pytest.mark.slow
def test_autotune_locally_skips_what_cannot_fit_records_a_real_oom_and_recommends(tmp_path):
    sweep = tmp_path / "sweep"
    proc = autotune(
        tmp_path,
        "zero=stage0",
        "offload=none,cpu",
        "train.micro_batch_size=2,1024,8192",
        f"hydra.sweep.dir={sweep}",
        limit_data=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "6 candidates at world size 1" in proc.stdout and "2 probed, 1 ruled out by the memory estimate, 3 not" in (
        proc.stdout
    )
    rows = ranking(sweep)
    fits = rows["offload=none train.micro_batch_size=2"]
    assert fits["result"] == "fits" and fits["rank"] == "1 (recommended)" and float(fits["tokens_per_s"]) > 0
    oom = rows["offload=none train.micro_batch_size=1024"]
    assert oom["result"] == "out of memory" and oom["rank"] == ""
    summary = json.loads((sweep / oom["job"] / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error_kind"] == "out_of_memory"
    assert "can't allocate memory" in summary["error"]  # torch's CPU allocator, under the real limit
    ruled_out = rows["offload=none train.micro_batch_size=8192"]
    assert ruled_out["result"].startswith("ruled out: estimated") and ruled_out["job"] == ""
    for micro in (2, 1024, 8192):
        assert rows[f"offload=cpu train.micro_batch_size={micro}"]["result"].startswith(
            "not applicable: offload.optimizer=cpu needs ZeRO stage 1, 2 or 3"
        )
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1"]  # nothing else was launched
    assert "## Autotune" in (sweep / "report.md").read_text()
    check_dry_run_of(recommended_command(proc.stdout), tmp_path, {"zero_stage": 0, "micro": 2})


@pytest.mark.slow
def test_autotune_on_slurm_runs_each_probe_as_a_two_rank_job(slurm, tmp_path):  # noqa: F811
    """No memory limit here: under `ulimit -d` a rank can fail inside submitit's own result pickling, and then the
    sweep waits for that job forever (seen with a 1.4 GiB limit); the recorded OOM is proven locally above.
    The probes tune DPO (issue 40): a micro batch of 2048 pairs is 4096 rows, ruled out by the 4 GiB budget where
    2048 rows of SFT would fit; the recommended command keeps objective=dpo."""
    sweep = tmp_path / "sweep"
    proc = autotune(
        tmp_path,
        "objective=dpo",
        "data.synthetic.num_train=256",  # DPO's reference is computed for every pair before a probe's first step
        "zero=stage1,stage2",
        "offload=none",
        "train.micro_batch_size=2,2048",
        "hydra/launcher=slurm",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=15",
        f"hydra.sweep.dir={sweep}",
        limit_data=False,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "4 candidates at world size 2" in proc.stdout and "2 probed, 2 ruled out" in proc.stdout
    rows = ranking(sweep)
    probes = [rows[f"zero=stage{z} train.micro_batch_size=2"] for z in (1, 2)]
    assert sorted(r["rank"] for r in probes) == ["1 (recommended)", "2"]
    for row in probes:
        summary = json.loads((sweep / row["job"] / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["launcher"] == "submitit"
        assert float(row["tokens_per_s"]) > 0
        assert "reward_accuracy" in json.loads((sweep / row["job"] / "metrics.jsonl").read_text().splitlines()[-1])
    candidates = json.loads((sweep / "autotune.json").read_text())["candidates"]
    for z in (1, 2):
        assert rows[f"zero=stage{z} train.micro_batch_size=2048"]["result"].startswith("ruled out")
        (pairs,) = [c for c in candidates if {f"zero=stage{z}", "train.micro_batch_size=2048"} <= set(c["overrides"])]
        assert pairs["estimate_bytes"] - pairs["activation_bytes"] // 2 < 4 * 2**30 < pairs["estimate_bytes"]
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1"]  # only the probes were queued
    command = recommended_command(proc.stdout)
    assert command[3:6] == ["-m", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2"], command
    assert "objective=dpo" in command
    best = next(r for r in probes if r["rank"] == "1 (recommended)")
    check_dry_run_of(command, tmp_path, {"zero_stage": int(best["candidate"][len("zero=stage")]), "micro": 2})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("~hydra.sweeper.params", "experiment=autotune: the grid is empty"),
        ("hydra.sweeper.memory_budget=1MiB", "experiment=autotune: nothing fits the memory budget of 1.00 MiB per"),
        ("hydra.sweeper.memory_budget=lots", "hydra.sweeper.memory_budget=lots: expected auto or a positive size"),
        ("lora.dim=-1", "experiment=autotune: none of the 32 candidates is a valid configuration"),
        # settings that cannot measure: every probe 'fit' and then none was timed, rc 0; nothing ran, unnamed
        ("train.max_steps=1", "experiment=autotune: the probes would not measure what the grid says"),
        ("hydra.sweeper.max_batch_size=-1", "hydra.sweeper.max_batch_size=-1: the probes handed to the launcher"),
    ],
)
def test_bad_autotune_settings_get_one_message_and_launch_nothing(tmp_path, override, message):
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "experiment=autotune", override, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith(f"ds_exp: error: {message}"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not sweep.exists()


def test_zero_stage_the_deepspeed_file_sets_is_named_in_the_refusal(tmp_path):
    """A DeepSpeed file that sets the swept stage: both probes ran ZeRO-3 and the report recommended zero=stage1.
    Now each value the file would beat is named, with the file, and nothing is launched."""
    (tmp_path / "z3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    proc = run_cli(
        "-m",
        "experiment=autotune",
        "zero=stage1,stage3",
        f"deepspeed.config_file={tmp_path / 'z3.json'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"zero=stage1 would not be used: deepspeed.config_file={tmp_path / 'z3.json'} sets " in proc.stderr
    assert "zero_optimization.stage=3" in proc.stderr and "zero=stage3 would not" not in proc.stderr
    assert not (tmp_path / "sweep").exists()


# ------------------------------------------------------------------ the report's verdict, in this process (fast)


def fake_autotune_sweep(sweep_dir, metric_steps: list[int], overrides: list[str]) -> None:
    """An autotune sweep directory with one completed probe whose metric lines close at `metric_steps`."""
    from ds_exp.tools.autotune import PLAN_FILE

    job = sweep_dir / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (job / "summary.json").write_text(json.dumps({"status": "completed", "world_size": 1}))
    lines = [{"type": "train", "step": s, "tokens_per_s": 100.0 * s} for s in metric_steps]
    (job / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    plan = {
        "world_size": 1,
        "accelerator": "cpu",
        "memory_budget_bytes": 2**30,
        "memory_budget_source": "test",
        "swept": ["zero"],
        "probe_keys": ["experiment", "train.max_steps"],
        "launcher_overrides": [],
        "candidates": [{"overrides": overrides, "job": "0", "verdict": "probe", "reason": None, "estimate_bytes": 1}],
    }
    (sweep_dir / PLAN_FILE).write_text(json.dumps(plan))


def test_probes_that_were_never_timed_recommend_nothing_and_exit_non_zero(tmp_path, capsys):
    from omegaconf import OmegaConf

    from ds_exp.sweeps.callbacks import SweepReport

    fake_autotune_sweep(tmp_path, [1], ["zero=stage1", "experiment=autotune", "train.max_steps=1"])
    config = OmegaConf.create({"dry_run": False, "hydra": {"sweep": {"dir": str(tmp_path)}, "sweeper": {}}})
    with pytest.raises(SystemExit) as exited:
        SweepReport().on_multirun_end(config)  # as Hydra calls it at the sweep's end
    assert exited.value.code == 1
    captured = capsys.readouterr()
    assert "ds_exp: error: autotune: no probe was timed (no metric line after its 1 warm-up step" in captured.err
    assert "completed, not timed" in (tmp_path / "autotune.csv").read_text()


def test_a_probes_speed_leaves_out_every_line_that_holds_its_warm_up(tmp_path):
    from ds_exp.sweeps.report import probe_speed

    job = tmp_path / "sweep"
    fake_autotune_sweep(job, [2, 4, 6], ["zero=stage1"])  # train.log_every=2: the step-2 line holds step 1
    assert probe_speed(job / "0") == (500.0, None)  # the median of 400 and 600, not of 200, 400 and 600


def test_the_recommended_command_carries_no_probe_or_session_override(tmp_path, capsys):
    """The probe session's resume=auto (a continued autotune sweep) is no part of the configuration it found."""
    from ds_exp.sweeps.report import write_report

    overrides = ["zero=stage1", "experiment=autotune", "train.max_steps=6", "resume=auto", "optimizer.lr=1e-4"]
    fake_autotune_sweep(tmp_path, [1, 2, 3], overrides)
    write_report(tmp_path)
    command = recommended_command(capsys.readouterr().out)
    assert command == ["python", "-m", "ds_exp", "zero=stage1", "optimizer.lr=1e-4"], command
