"""A run directory remembers its run (issue 22 §2): `hydra.run.dir=R resume=auto` continues with R's own config and
names each change given with it; metrics.jsonl (and wandb) hold one line per step after a resume from an earlier
checkpoint; two runs started in the same second get distinct directories; a run refused by validation leaves no
stub under outputs/; a sweep job resumed with its sweep continues with its own config, as a single run does."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ds_exp.artifacts import tracking
from ds_exp.artifacts.trackers.base import TrackedRun
from ds_exp.config.paths import conf_dir
from ds_exp.launch.lock import release_run_dir
from ds_exp.launch.run_config import (
    KEPT_DIR,
    continue_run_config,
    finish_job_attempt,
    keep_job_config,
    saved_run_config,
    take_job_config,
)
from ds_exp.launch.run_dir import check_run_start
from tests.conftest import run_cli
from tests.training import FAST, multirun


def _hydra_config(*overrides: str):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def _save_attempt(run_dir: Path, subdir: str, *overrides: str) -> None:
    """What Hydra saves of an attempt: its task config (no hydra node) in <run dir>/<subdir>/config.yaml."""
    config = _hydra_config(*overrides)
    task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
    (run_dir / subdir).mkdir(parents=True)
    OmegaConf.save(task, run_dir / subdir / "config.yaml")


def test_a_resume_continues_with_the_runs_own_config_and_names_each_change(tmp_path):
    """It used to continue with the defaults: 200 -> 250 steps, save_every 40 -> 0 unmentioned."""
    run = tmp_path / "R"
    _save_attempt(run, ".hydra", "train.max_steps=200", "train.save_every=40", "lora.dim=4", "optimizer.lr=3e-4")
    overrides = ["resume=auto", "train.max_steps=300", "zero=stage1", "optimizer.lr=3e-4"]
    config = _hydra_config(f"hydra.run.dir={run}", *overrides)
    changed = continue_run_config(config, run, overrides)
    assert (config.train.max_steps, config.train.save_every, config.lora.dim) == (300, 40, 4)  # its own, and the change
    assert config.zero.stage == 1 and config.resume == "auto"
    assert changed is not None and "train.max_steps: 200 -> 300" in changed and "zero.stage: 0 -> 1" in changed
    assert not [line for line in changed if "save_every" in line or "optimizer.lr" in line]  # unchanged: not named

    # the newest attempt's config is the run's: a later resume (here at 300 steps) is what it continues
    _save_attempt(run, ".hydra/resume-2030-01-01_00-00-00", "train.max_steps=300", "train.save_every=40")
    assert saved_run_config(run) == run / ".hydra/resume-2030-01-01_00-00-00/config.yaml"
    again = _hydra_config(f"hydra.run.dir={run}", "resume=auto")
    assert continue_run_config(again, run, ["resume=auto"]) == []
    assert again.train.max_steps == 300 and again.lora.dim == 0

    # a directory that saved no config: nothing to continue from, the composition stays as it is
    fresh = _hydra_config(f"hydra.run.dir={tmp_path / 'none'}", "resume=auto")
    assert continue_run_config(fresh, tmp_path / "none", ["resume=auto"]) is None and fresh.train.max_steps == -1


def test_a_resume_drops_the_killed_attempts_lines_past_its_checkpoint(tmp_path, monkeypatch, compose_cfg):
    """metrics.jsonl held steps 130 and 140 twice after a resume from 120."""
    path = tmp_path / "metrics.jsonl"
    lines = [{"type": "train", "step": s} for s in range(1, 15)] + [{"type": "eval", "step": 12}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    log = tracking.MetricsLog(path, enabled=True, start_step=10)
    log.write({"type": "train", "step": 11})
    log.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [*range(1, 11), 11]  # one line per step of the course the run followed
    (aside,) = (tmp_path / "attempts").glob("*/metrics.after_step10.jsonl")
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == [11, 12, 13, 14, 12]  # kept

    # wandb agrees: the resumed wandb run is rewound to the checkpoint's step, not continued past the killed steps
    seen: dict = {}

    from ds_exp.artifacts.trackers import wandb as wandb_tracker

    class FakeRun:
        id = "run123"
        dir = str(tmp_path / "wandb" / "offline-run-x" / "files")

    fake_wandb = type(sys)("wandb")
    fake_wandb.init = lambda **kwargs: seen.update(kwargs) or FakeRun()
    fake_wandb.Settings = lambda **kwargs: kwargs
    monkeypatch.setattr(wandb_tracker, "wandb", fake_wandb)
    cfg = compose_cfg("logger=wandb", "logger.wandb.mode=offline")
    wandb_tracker.WandbRun(cfg.logger.wandb, TrackedRun.of(cfg, tmp_path), run_id="run123", start_step=10)
    assert seen["resume_from"] == "run123?_step=10" and "resume" not in seen
    wandb_tracker.WandbRun(cfg.logger.wandb, TrackedRun.of(cfg, tmp_path), run_id=None, start_step=0)
    assert seen["resume"] == "allow"


def test_two_runs_started_in_the_same_second_get_distinct_directories(tmp_path, monkeypatch):
    """The second used to stop: "in use by a live ds_exp run", telling the user to leave hydra.run.dir unset."""
    monkeypatch.chdir(tmp_path)
    config = _hydra_config("hydra.run.dir=outputs/default/2030-01-01_00-00-00")
    # as Hydra chose it (${now:...}), not named on the command line
    config.hydra.overrides.hydra = []
    taken = tmp_path / "outputs/default/2030-01-01_00-00-00"
    taken.mkdir(parents=True)
    holder = subprocess.Popen(  # a live run holding that directory's lock
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', "
            "flush=True); time.sleep(60)",
            str(taken / ".ds_exp.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        check_run_start(config)
        assert config.hydra.run.dir == "outputs/default/2030-01-01_00-00-00_1"
        release_run_dir(Path(config.hydra.run.dir))
    finally:
        holder.kill()
        holder.wait()


def test_a_run_refused_by_validation_leaves_no_stub_directory(tmp_path):
    refused = run_cli("train.micro_batch_size=0", cwd=tmp_path)
    assert refused.returncode == 2 and "train.micro_batch_size=0: must be >= 1" in refused.stderr
    assert not (tmp_path / "outputs").exists(), list((tmp_path / "outputs").rglob("*"))


@pytest.mark.slow
def test_a_resume_from_the_command_line_continues_its_own_run(tmp_path, cache_dir):
    """Through the CLI: the run's own settings (lora, save interval, length) carry over, the change given is named,
    and metrics.jsonl holds each step once after a resume from an earlier checkpoint."""
    run = tmp_path / "R"
    first = run_cli(
        f"hydra.run.dir={run}", *FAST, "train.max_steps=6", "train.save_every=2", "train.keep_last=0",
        "lora.dim=4", f"data.cache_dir={cache_dir}", cwd=tmp_path,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    time.sleep(1)  # the resume's .hydra/resume-<second>/
    again = run_cli(f"hydra.run.dir={run}", f"resume={run}/checkpoints/step4", "optimizer.lr=5e-4", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continues with its own config (.hydra/config.yaml), changed by this command line:" in again.stderr
    assert "optimizer.lr: 0.001 -> 0.0005" in again.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["status"] == "completed"
    (resumed,) = (run / ".hydra").glob("resume-*/config.yaml")
    saved = OmegaConf.load(resumed)
    assert (saved.lora.dim, saved.train.save_every, saved.train.max_steps) == (4, 2, 6)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [line["step"] for line in lines if line["type"] == "train"]
    assert train_steps == [1, 2, 3, 4, 5, 6]


def test_a_sweep_job_launch_that_never_ended_keeps_the_first_attempts_files(tmp_path):
    """Killed after Hydra wrote the job's .hydra/ and before the job ended: the next launch continues from what the
    killed one ran with, and the files kept aside stay the first attempt's until a job ends and puts them back."""
    job = tmp_path / "S" / "0"
    _save_attempt(job, ".hydra", "train.max_steps=4", "lora.dim=4")
    (job / ".hydra/overrides.yaml").write_text("- train.max_steps=4\n")
    keep_job_config(job, _hydra_config("train.max_steps=6", "lora.dim=4"))
    (job / ".hydra/config.yaml").write_text("written: by Hydra for the killed launch\n")
    (job / ".hydra/overrides.yaml").write_text("- train.max_steps=6\n")
    config = _hydra_config("resume=auto", "train.save_every=2")  # in the same second or not: named after the last
    assert continue_run_config(config, job, ["resume=auto", "train.save_every=2"]) == ["train.save_every: 0 -> 2"]
    keep_job_config(job, config)
    composed = _hydra_config("resume=auto")
    composed = OmegaConf.masked_copy(composed, [k for k in composed if k != "hydra"])  # what the task gets
    assert take_job_config(composed, job, first_rank=True)
    assert (composed.train.max_steps, composed.train.save_every, composed.lora.dim) == (6, 2, 4)
    finish_job_attempt(job)
    assert OmegaConf.load(job / ".hydra/config.yaml").train.max_steps == 4  # the first attempt's, back in place
    assert (job / ".hydra/overrides.yaml").read_text() == "- train.max_steps=4\n"
    assert not (job / ".hydra" / KEPT_DIR).exists()
    assert [OmegaConf.load(p).train.max_steps for p in sorted(job.glob(".hydra/resume-*/config.yaml"))] == [6, 6]
    fresh = OmegaConf.masked_copy(composed, ["train"])
    assert not take_job_config(fresh, tmp_path / "S" / "1", first_rank=True)  # a job the sweep kept nothing for


@pytest.mark.slow
def test_a_resumed_sweep_job_continues_with_its_own_config(tmp_path, cache_dir):
    """The same sweep command with resume=auto used to compose each job again from the defaults and the sweep's
    overrides (LoRA, save interval, batch, data all lost: here refused, the checkpoint's layout differs), and Hydra
    wrote the job's .hydra/config.yaml over the first attempt's before the job could read it."""
    sweep = tmp_path / "S"
    first = multirun(
        tmp_path, sweep, "zero=stage1,stage2", *FAST, "train.max_steps=4", "train.save_every=2", "train.keep_last=0",
        "lora.dim=4", f"data.cache_dir={cache_dir}",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    again = multirun(tmp_path, sweep, "zero=stage1,stage2", "resume=auto", "train.max_steps=6")
    assert again.returncode == 0, again.stderr[-3000:]
    for job, stage in (("0", 1), ("1", 2)):
        job_dir = sweep / job
        note = f"resume: sweep job {job_dir} continues with its own config (.hydra/config.yaml), changed by this "
        assert f"{note}command line:\n" in again.stderr, again.stderr[-3000:]
        said = again.stderr.split(f"{note}command line:\n", 1)[1].splitlines()[:2]
        assert [line for line in said if line.startswith("  ")] == ["  train.max_steps: 4 -> 6"]  # that one only
        summary = json.loads((job_dir / "summary.json").read_text())
        assert (summary["status"], summary["steps"]) == ("completed", 6)
        assert (job_dir / "checkpoints" / "step6").is_dir()  # its own save_every=2 (the default saves none)
        # .hydra/ holds the first attempt's files; this attempt's config, the one it ran with, is beside them
        assert OmegaConf.load(job_dir / ".hydra/config.yaml").train.max_steps == 4
        assert "train.max_steps=4" in (job_dir / ".hydra/overrides.yaml").read_text()
        (attempt,) = (job_dir / ".hydra").glob("resume-*")
        hydra_files = {p.name for p in (job_dir / ".hydra").iterdir()}
        assert hydra_files == {"config.yaml", "hydra.yaml", "overrides.yaml", attempt.name}  # nothing kept aside left
        saved = OmegaConf.load(attempt / "config.yaml")
        assert (saved.train.max_steps, saved.train.save_every, saved.lora.dim, saved.zero.stage) == (6, 2, 4, stage)
        assert (saved.train.micro_batch_size, saved.data.cache_dir) == (4, str(cache_dir))
        assert (attempt / "hydra.yaml").is_file() and "train.max_steps=6" in (attempt / "overrides.yaml").read_text()
        train_steps = [r["step"] for r in map(json.loads, (job_dir / "metrics.jsonl").read_text().splitlines())
                       if r["type"] == "train"]  # fmt: skip
        assert train_steps == [1, 2, 3, 4, 5, 6]
