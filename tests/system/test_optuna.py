"""hydra/sweeper=optuna (ds_exp/sweeps/optuna_study.py): real studies of real runs, each trial a full run (2 ranks
through
submitit's local executor or the one-node SLURM cluster, or one process under the basic launcher); the search
space and the study record on their own (fast)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.system.test_slurm import slurm  # noqa: F401  (the fixture: a running one-node cluster)
from tests.training import FAST, REPO, multirun, user_env

SEARCH = ["hydra/sweeper=optuna", "optimizer.lr=tag(log,interval(1e-5,1e-3))", "hydra.sweeper.sampler.seed=0"]
# constant schedule: the learning rate of step 1 is the trial's too
TINY = [*FAST, "train.max_steps=2", "scheduler=constant"]
LR_LINE = re.compile(r"learning rate per parameter group: peak \[([^\]]*)\], step 1 \[([^\]]*)\]")


def study_trials(sweep_dir: Path) -> list:
    import optuna

    name = json.loads((sweep_dir / "study.json").read_text())["study_name"]  # default-lr-<digest of the search>
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    return study.get_trials(deepcopy=False)


def rank_lrs(job_dir: Path) -> dict[str, list[float]]:
    """Each rank's own record of its optimizer's learning rates (peak and step 1, every parameter group)."""
    lrs = {}
    for log_file in sorted((job_dir / "logs").glob("rank*.log")):
        match = LR_LINE.search(log_file.read_text())
        assert match, f"{log_file} has no learning-rate line"
        lrs[log_file.stem] = [float(x) for part in match.groups() for x in part.split(",")]
    return lrs


def assert_ranks_trained_with_the_trials_lr(sweep_dir: Path, trial, world_size: int) -> None:
    job_dir = sweep_dir / str(trial.number)
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == world_size
    assert trial.value == summary["final_eval"]["eval_loss"]
    lrs = rank_lrs(job_dir)
    assert sorted(lrs) == [f"rank{r}" for r in range(world_size)]
    for rank, values in lrs.items():
        assert values and all(v == trial.params["optimizer.lr"] for v in values), (rank, values, trial.params)


@pytest.mark.slow
def test_two_rank_trials_train_with_the_trials_lr_and_a_rerun_continues_the_study(tmp_path, cache_dir):
    sweep_dir = tmp_path / "study"
    args = [*SEARCH, *TINY, "hydra/launcher=local", "hydra.launcher.tasks_per_node=2", f"data.cache_dir={cache_dir}"]
    # one trial, then a rerun for a second (two trials in one sweep: the failed, diverged and SLURM studies below)
    first = multirun(tmp_path, sweep_dir, *args, "hydra.sweeper.n_trials=1", timeout=1500)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "0 of 1 trials finished" in first.stdout
    trials = study_trials(sweep_dir)
    assert [t.state.name for t in trials] == ["COMPLETE"]
    assert_ranks_trained_with_the_trials_lr(sweep_dir, trials[0], world_size=2)
    before = (sweep_dir / "0" / "summary.json").read_bytes()

    # the same command with a larger n_trials: one more trial, the first kept as it is
    second = multirun(tmp_path, sweep_dir, *args, "hydra.sweeper.n_trials=2", timeout=1500)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "1 of 2 trials finished" in second.stdout
    trials = study_trials(sweep_dir)
    assert [(t.number, t.state.name) for t in trials] == [(0, "COMPLETE"), (1, "COMPLETE")]
    assert trials[1].params != trials[0].params  # the sampler (seed 0) did not start over
    assert_ranks_trained_with_the_trials_lr(sweep_dir, trials[1], world_size=2)
    assert (sweep_dir / "0" / "summary.json").read_bytes() == before
    assert sorted(p.name for p in sweep_dir.iterdir() if p.name.isdigit()) == ["0", "1"]

    # the report names the best trial and the command that trains it again
    best = min(trials, key=lambda t: t.value)
    report = (sweep_dir / "report.md").read_text()
    assert f"Best trial: {best.number}, final_eval.eval_loss={best.value:.6g}" in report
    assert "torchrun --nproc_per_node=2 -m ds_exp " in report
    assert f"optimizer.lr={best.params['optimizer.lr']!r}" in report.split("Best trial:")[1]
    record = json.loads((sweep_dir / "study.json").read_text())
    assert record["best"]["number"] == best.number and len(record["trials"]) == 2

    # and once more: the study is complete, nothing runs
    third = multirun(tmp_path, sweep_dir, *args, "hydra.sweeper.n_trials=2", timeout=600)
    assert third.returncode == 0, third.stderr[-4000:]
    assert "2 of 2 trials finished, nothing to run" in third.stdout
    assert len(study_trials(sweep_dir)) == 2


@pytest.mark.slow
def test_a_failed_trial_is_recorded_and_the_study_goes_on(tmp_path, cache_dir):
    """One of the two LoRA scopes matches no layer: that run fails, the study records it and completes the other."""
    sweep_dir = tmp_path / "study"
    proc = multirun(
        tmp_path,
        sweep_dir,
        "hydra/sweeper=optuna",
        "hydra.sweeper.sampler._target_=optuna.samplers.BruteForceSampler",  # each choice once
        "hydra.sweeper.n_trials=2",
        "lora.module_name=nomatch.,layers.",
        "lora.dim=4",
        *TINY,
        f"data.cache_dir={cache_dir}",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    trials = study_trials(sweep_dir)
    states = {t.params["lora.module_name"]: t for t in trials}
    assert {name: t.state.name for name, t in states.items()} == {"nomatch.": "FAIL", "layers.": "COMPLETE"}
    failed, completed = states["nomatch."], states["layers."]
    assert "matches no Linear layer" in failed.user_attrs["error"]
    assert f"trial {failed.number} fail:" in proc.stdout
    report = (sweep_dir / "report.md").read_text()
    assert re.search(
        rf"\| {failed.number} \| FAIL \|  \| lora.module_name=nomatch. \| .*matches no Linear layer", report
    )
    assert f"Best trial: {completed.number}," in report
    assert "python -m ds_exp " in report and "lora.module_name=layers." in report.split("Best trial:")[1]


@pytest.mark.slow
def test_a_diverged_trial_is_pruned(tmp_path, cache_dir):
    """A learning rate that overflows fp32: the run stops on its non-finite losses (status `diverged`), the study
    records the trial as pruned (the values were bad, not the set-up) and goes on. A credential given with the
    study's fixed overrides reaches none of its files (optuna.db, study.json, the report) nor its console."""
    pat = "study-deploy-pat-0c9d41"
    sweep_dir = tmp_path / "study"
    proc = multirun(
        tmp_path,
        sweep_dir,
        "hydra/sweeper=optuna",
        "hydra.sweeper.sampler._target_=optuna.samplers.BruteForceSampler",
        "hydra.sweeper.n_trials=2",
        "optimizer.lr=1e-4,1e8",
        *FAST,
        "scheduler=constant",
        "train.gradient_clipping=0",
        "train.max_bad_steps=0",
        f"+logger.deploy_pat={pat}",
        f"data.cache_dir={cache_dir}",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    states = {t.params["optimizer.lr"]: t for t in study_trials(sweep_dir)}
    assert {lr: t.state.name for lr, t in states.items()} == {1e-4: "COMPLETE", 1e8: "PRUNED"}
    assert "non-finite loss" in states[1e8].user_attrs["error"] and states[1e8].value is None
    pruned_job = Path(states[1e8].user_attrs["job_dir"])
    assert json.loads((pruned_job / "summary.json").read_text())["status"] == "diverged"
    assert "| PRUNED |" in (sweep_dir / "report.md").read_text()
    leaks = [p for p in sweep_dir.rglob("*") if p.is_file() and pat.encode() in p.read_bytes()]
    assert leaks == [] and pat not in proc.stdout + proc.stderr, leaks
    assert "+logger.deploy_pat=${oc.env:DS_EXP_SECRET_LOGGER_DEPLOY_PAT}" in (sweep_dir / "report.md").read_text()


@pytest.mark.slow
def test_an_objective_no_run_reports_stops_the_study_with_the_numbers_it_could_use(tmp_path, cache_dir):
    sweep_dir = tmp_path / "study"
    # mfu needs the device's peak FLOPS, unknown for a CPU: the run completes, its summary.json has mfu: null.
    # sampler=null: the study keeps optuna's default sampler (it once set study.sampler = None and failed to ask)
    proc = multirun(
        tmp_path,
        sweep_dir,
        *SEARCH[:2],
        "hydra.sweeper.sampler=null",
        "hydra.sweeper.objective=mfu",
        "hydra.sweeper.n_trials=3",
        *TINY,
        f"data.cache_dir={cache_dir}",
        timeout=900,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "hydra.sweeper.objective=mfu: trial 0's run completed but its summary.json" in proc.stderr
    assert "final_eval.eval_loss" in proc.stderr and "Traceback" not in proc.stderr
    assert len(study_trials(sweep_dir)) == 1  # stopped after the first trial, not after three


@pytest.mark.slow
def test_a_trial_stopped_by_ctrl_c_is_continued_by_the_rerun_not_failed(tmp_path, cache_dir):
    """Ctrl-C during a trial: the run saves a checkpoint and the sweep ends with the trial still RUNNING in the
    study. The same command again used to record it FAIL (counted toward n_trials); now it continues it: the same
    trial number and values, from its checkpoint."""
    import signal
    import time

    from tests.training import logged_steps

    sweep_dir = tmp_path / "study"
    args = [
        sys.executable,
        "-m",
        "ds_exp",
        "-m",
        *SEARCH,
        "hydra.sweeper.n_trials=1",
        *FAST,
        "train.max_steps=60",
        "data.synthetic.num_train=1024",
        f"data.cache_dir={cache_dir}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    first = subprocess.Popen(
        args, cwd=tmp_path, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while logged_steps(sweep_dir / "0") < 2:
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGINT)  # what Ctrl-C sends the foreground process
        _, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 128 + signal.SIGINT, err[-3000:]
    stopped = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert stopped["status"] == "stopped" and stopped["steps"] < 60, stopped
    (trial,) = study_trials(sweep_dir)
    assert trial.state.name == "RUNNING"

    again = subprocess.run(args, cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "trial 0 was stopped before it finished: continuing it from its checkpoint" in again.stdout
    (continued,) = study_trials(sweep_dir)  # the same trial, not a failed one and a new one
    assert (continued.number, continued.state.name, continued.params) == (0, "COMPLETE", trial.params)
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 60
    assert summary["resumed_from"].endswith(f"checkpoints/step{stopped['steps']}"), summary["resumed_from"]
    assert continued.value == summary["final_eval"]["eval_loss"]
    assert "resume=auto" not in json.loads((sweep_dir / "study.json").read_text())["best"]["command"]


def test_a_searched_key_the_deepspeed_file_sets_stops_the_study_before_any_trial(tmp_path):
    (tmp_path / "z3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    sweep_dir = tmp_path / "study"
    proc = multirun(
        tmp_path,
        sweep_dir,
        "hydra/sweeper=optuna",
        "zero=stage1,stage3",
        f"deepspeed.config_file={tmp_path / 'z3.json'}",
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"zero=stage1 would not be used: deepspeed.config_file={tmp_path / 'z3.json'} sets" in proc.stderr
    assert "Traceback" not in proc.stderr and not sweep_dir.exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["hydra.sweeper.objective=accuracy", "optimizer.lr=interval(1e-5,1e-3)"], "no run's summary.json reports it"),
        (["optimizer.lr=1e-4"], "hydra/sweeper=optuna needs a search space"),
        (["optimizer.lr=interval(1e-3,1e-5)"], "interval(0.001, 1e-05) is empty"),
        (["optimizer.nosuch=interval(1,2)"], "cannot be composed"),
    ],
)
def test_a_study_that_cannot_run_is_refused_before_any_trial(tmp_path, overrides, message):
    sweep_dir = tmp_path / "study"
    proc = multirun(tmp_path, sweep_dir, "hydra/sweeper=optuna", *overrides, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (sweep_dir / "optuna.db").exists()


def test_the_sweeper_is_found_from_any_directory_as_installed(tmp_path):
    """A user's shell has no PYTHONPATH to the checkout: Hydra's plugin scan must still find our sweeper under the
    editable install that the README's set-up makes (it did not: 'Unknown plugin class')."""
    env = {k: v for k, v in user_env().items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [sys.executable, "-c", "import ds_exp, pathlib; print(pathlib.Path(ds_exp.__file__).parent.parent)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    if where.returncode != 0 or Path(where.stdout.strip()) != REPO:
        pytest.skip("this checkout is not the installed ds_exp (pip install -e .): nothing installed to test")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_exp",
            "-m",
            "hydra/sweeper=optuna",
            "optimizer.lr=1e-4",
            f"hydra.sweep.dir={tmp_path / 'study'}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # our sweeper ran (its own refusal), rather than Hydra failing to find it
    assert proc.returncode == 2 and "hydra/sweeper=optuna needs a search space" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_study_on_slurm_with_two_ranks_per_trial(slurm, tmp_path, cache_dir):  # noqa: F811
    sweep_dir = tmp_path / "study"
    proc = multirun(
        tmp_path,
        sweep_dir,
        *SEARCH,
        "hydra.sweeper.n_trials=2",
        "hydra/launcher=slurm",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=15",
        *TINY,
        f"data.cache_dir={cache_dir}",
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    trials = study_trials(sweep_dir)
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    for trial in trials:
        assert_ranks_trained_with_the_trials_lr(sweep_dir, trial, world_size=2)
        rank1 = (sweep_dir / str(trial.number) / "logs" / "rank1.log").read_text()
        assert "launch submitit: rank 1 of 2" in rank1


# ---------------------------------------------------------------------------------- fast: space and record


def test_the_command_line_grammar_becomes_optuna_distributions():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from ds_exp.sweeps.search_space import parse_search_space

    space = parse_search_space(
        [
            "optimizer.lr=tag(log,interval(1e-5,1e-3))",
            "train.micro_batch_size=range(1,5)",
            "lora.dim=tag(int,interval(4,16))",
            "zero=stage2,stage3",
            "train.max_steps=8",
        ]
    )
    assert space.distributions == {
        "optimizer.lr": FloatDistribution(1e-5, 1e-3, log=True),
        "train.micro_batch_size": IntDistribution(1, 4),  # range() stops before its end, as Hydra's does
        "lora.dim": IntDistribution(4, 16),
        "zero": CategoricalDistribution(["stage2", "stage3"]),
    }
    assert space.fixed == ["train.max_steps=8"]
    lr = 0.00012520653814999459
    overrides = space.overrides({"optimizer.lr": lr, "train.micro_batch_size": 3, "lora.dim": 8, "zero": "stage3"})
    assert overrides == [
        "train.max_steps=8",
        f"optimizer.lr={lr!r}",
        "train.micro_batch_size=3",
        "lora.dim=8",
        "zero=stage3",
    ]
    assert float(overrides[1].split("=")[1]) == lr  # every rank parses back the very same float


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("a=tag(log,interval(0,1))", "a log interval needs low > 0"),
        ("a=interval(2,1)", "is empty"),
        ("a=tag(foo,interval(1,2))", "unknown tag ['foo']"),
        ("a=range(5,1)", "range() is empty"),
        ("a=tag(log,choice(1,2))", "tags (log, int) shape an interval() or an integer range() only"),
    ],
)
def test_a_search_expression_that_cannot_be_searched_is_named(override, message):
    from ds_exp.core.errors import ConfigError
    from ds_exp.sweeps.search_space import parse_search_space

    with pytest.raises(ConfigError) as err:
        parse_search_space([override])
    assert f"bad search space: {override}: " in str(err.value) and message in str(err.value)


def test_a_study_continues_only_with_the_settings_it_started_with(tmp_path):
    from ds_exp.core.errors import ConfigError
    from ds_exp.sweeps.study_files import STUDY_FILE, check_study_dir

    identity = {"study_name": "s", "storage": "sqlite:///x", "objective": "final_eval.eval_loss"}
    identity |= {"direction": "minimize", "search_space": {"optimizer.lr": "{}"}, "fixed": ["train.max_steps=8"]}
    check_study_dir(tmp_path, identity)  # a new directory: nothing to compare
    (tmp_path / STUDY_FILE).write_text(json.dumps({**identity, "n_trials": 3, "trials": []}))
    check_study_dir(tmp_path, identity)  # the same settings continue it
    with pytest.raises(ConfigError) as err:
        check_study_dir(tmp_path, {**identity, "fixed": ["train.max_steps=9"]})
    assert "every trial got train.max_steps=8, now train.max_steps=9" in str(err.value)
    assert "leave hydra.sweeper.study_name unset" in str(err.value) and "hydra.sweeper.study_name=s-2" in str(err.value)


def test_the_best_trials_command_trains_it_again_with_as_many_ranks():
    from ds_exp.sweeps.study_files import command_line

    assert command_line(["optimizer.lr=0.0001", "data.name=a b"], 2) == (
        "torchrun --nproc_per_node=2 -m ds_exp optimizer.lr=0.0001 'data.name=a b'"
    )
    assert command_line(["zero=stage2"], 1) == "python -m ds_exp zero=stage2"


def test_a_storage_that_cannot_be_opened_here_is_one_message_naming_it():
    from ds_exp.core.errors import ConfigError
    from ds_exp.sweeps.optuna_study import check_storage

    cases = {
        "mysql://me:hunter2@db.example/optuna": "hydra.sweeper.storage=mysql://me:***@db.example/optuna: the mysql "
        "driver mysqldb is not installed (no module 'MySQLdb'); pip install mysqlclient, name an installed driver",
        "postgresql+pg8000://me@db/optuna": "the postgresql driver pg8000 is not installed (no module 'pg8000'); pip",
        "redis://localhost": "hydra.sweeper.storage=redis://localhost: SQLAlchemy knows no database 'redis'",
        "optuna.db": "hydra.sweeper.storage=optuna.db: not a database URL; give one",
    }
    for storage, expected in cases.items():
        with pytest.raises(ConfigError) as info:
            check_storage(storage)
        assert expected in str(info.value) and "hunter2" not in str(info.value), str(info.value)
        assert "leave hydra.sweeper.storage unset for a SQLite file in the sweep directory" in str(info.value)
    check_storage("sqlite:////tmp/study.db")  # the driver is Python's own
