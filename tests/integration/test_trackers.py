"""Trackers beside wandb (issue 22 §5): TensorBoard and MLflow, several at once, each read back with its own reader
(TensorBoard's EventAccumulator, MLflow's MlflowClient on the run's store): rank 0 only, no secret, and a resumed
run continues the same MLflow run and the same TensorBoard curves with each step once. Every tracker of the table
(ds_exp/config/trackers.py) builds, writes and ends through the one interface (issue 34)."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest

from ds_exp.artifacts.trackers.base import TrackedRun, Tracker
from ds_exp.artifacts.tracking import Trackers
from ds_exp.config.trackers import TRACKERS, logger_problems
from ds_exp.core import waits
from ds_exp.core.errors import RunFailed
from ds_exp.core.status import RunStatus
from ds_exp.resume.store import TrainState
from tests.integration.test_security import files_holding
from tests.training import FAST, launch

SECRET = "mlflow-secret-token-7c41d2"
TAG_PASSWORD = "mlflow-tag-pw-31c7e0"


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a scalar as TensorBoard shows it (purged steps hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def mlflow_runs(uri: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


@pytest.fixture(scope="session")
def migrated_mlflow_db(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store with its schema made: a copy at <run dir>/mlflow.db saves a test the seconds of
    MLflow's migrations (a store of a run's own is made by the 2-rank run below)."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def test_the_logger_options_combine(compose_cfg):
    cfg = compose_cfg("logger=[wandb,tensorboard,mlflow]")
    assert cfg.logger.tensorboard.enabled and cfg.logger.mlflow.enabled and cfg.logger.wandb.mode.value != "disabled"
    cfg = compose_cfg("logger=wandb")  # as before: wandb alone
    assert not cfg.logger.tensorboard.enabled and not cfg.logger.mlflow.enabled
    assert compose_cfg("logger=mlflow").logger.mlflow.tracking_uri is None  # the project's outputs/mlflow.db
    assert not any(t.enabled for t in (compose_cfg().logger.tensorboard, compose_cfg().logger.mlflow))


@pytest.mark.parametrize(
    ("overrides", "env", "fragment"),
    [
        (["logger=mlflow", "logger.mlflow.tracking_uri=./mlruns"], {}, "is MLflow's file store, which MLflow 3"),
        (["logger=mlflow", "logger.mlflow.tracking_uri=file:///tmp/x"], {}, "MLFLOW_ALLOW_FILE_STORE=true"),
        (["logger=mlflow", "logger.mlflow.tracking_uri=''"], {}, "logger.mlflow.tracking_uri is empty"),
        (["logger=mlflow", "logger.mlflow.experiment=' '"], {}, "logger.mlflow.experiment is empty"),
        (["logger=tensorboard", "logger.tensorboard.dir=''"], {}, "logger.tensorboard.dir is empty"),
        (["logger=mlflow", "logger.mlflow.tracking_uri=./mlruns"], {"MLFLOW_ALLOW_FILE_STORE": "true"}, None),
    ],
    ids=["file store path", "file store uri", "empty uri", "empty experiment", "empty tensorboard dir", "opted in"],
)
def test_tracker_settings_are_checked_before_anything_loads(compose_cfg, monkeypatch, overrides, env, fragment):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = compose_cfg(*overrides)
    problems = logger_problems(cfg.logger, dry_run=cfg.dry_run)
    assert (any(fragment in p for p in problems), len(problems)) == (True, 1) if fragment else problems == []


def test_a_resumed_tensorboard_run_shows_each_step_once(compose_cfg, tmp_path):
    """An attempt killed after its checkpoint at step 3 wrote steps 4-5; the resumed writer (purge_step 4) logs 4-6:
    TensorBoard shows 1-6 once, the resumed values past the checkpoint. Rank > 0 writes nothing."""
    from ds_exp.artifacts.trackers.tensorboard import TensorBoardRun

    cfg = compose_cfg("logger=tensorboard")
    killed = TensorBoardRun(cfg.logger.tensorboard, TrackedRun.of(cfg, tmp_path), run_id=None, start_step=0)
    for step in range(1, 6):
        killed.log({"train/loss": float(step), "train/note": "text is not a scalar"}, step)
    killed.writer.close()  # what the killed attempt left on disk (tensorboardX's flush() does not drain its queue)
    resumed = TensorBoardRun(cfg.logger.tensorboard, TrackedRun.of(cfg, tmp_path), run_id=None, start_step=3)
    for step in range(4, 7):
        resumed.log({"train/loss": 10.0 * step}, step)
    resumed.table("eval/generations", [{"prompt": "a|b", "completion": "c"}], 6)
    resumed.artifact("summary.json", {"status": "completed", "steps": 6})
    resumed.close(RunStatus.COMPLETED)
    shown = scalars(tmp_path / "tensorboard", "train/loss")
    assert shown == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    other_rank = Trackers(cfg.logger, TrackedRun.of(cfg, tmp_path / "rank1"), enabled=False, start=TrainState())
    other_rank.log({"train/loss": 1.0}, 1)
    other_rank.close(RunStatus.COMPLETED, {"status": "completed"})
    assert not (tmp_path / "rank1").exists()


@pytest.mark.parametrize("name", list(TRACKERS))
def test_every_tracker_of_the_table_builds_writes_and_ends(
    compose_cfg, tmp_path, monkeypatch, migrated_mlflow_db, name
):
    """Each entry of the table, a real tracker writing to a tmp directory (wandb offline, TensorBoard's event files,
    MLflow's SQLite store): built by the fan-out the run uses from `logger=<name>` alone, through the one interface,
    and its run id is what a checkpoint keeps."""
    monkeypatch.setenv("WANDB_MODE", "offline")  # conf/logger/wandb.yaml: $WANDB_MODE, else online
    monkeypatch.chdir(tmp_path)  # the project: MLflow's store is outputs/mlflow.db here
    (tmp_path / "outputs").mkdir()
    shutil.copy(migrated_mlflow_db, tmp_path / "outputs" / "mlflow.db")  # used by logger=mlflow only
    entry = TRACKERS[name]
    cfg = compose_cfg(f"logger={name}")
    trackers = Trackers(cfg.logger, TrackedRun.of(cfg, tmp_path), enabled=True, start=TrainState())
    (tracker,) = trackers.all
    assert isinstance(tracker, Tracker) and type(tracker) is entry.load_builder()
    trackers.log({"train/loss": 2.5, "train/note": "not a number"}, 1)
    trackers.table("eval/generations", [{"prompt": "p", "completion": "c"}], 1)
    trackers.close(RunStatus.COMPLETED, {"status": "completed", "steps": 1})
    assert tracker.store is not None and tmp_path in tracker.store.parents
    assert any(tracker.store.iterdir()) if tracker.store.is_dir() else tracker.store.stat().st_size
    assert trackers.ids() == ({entry.run_id_key: tracker.run_id} if entry.run_id_key else {})
    assert logger_problems(cfg.logger, dry_run=True) == []


@pytest.mark.slow  # MLflow's import and its SQLite store's first migration take seconds
def test_an_mlflow_run_continues_with_each_step_once_and_no_secret(
    compose_cfg, tmp_path, monkeypatch, capsys, migrated_mlflow_db
):
    from ds_exp.artifacts.trackers.mlflow import MlflowRun, default_tracking_uri
    from ds_exp.config.secrets import register_secrets

    monkeypatch.chdir(tmp_path)  # the project: its store is outputs/mlflow.db here
    monkeypatch.setenv("MY_SERVICE_TOKEN", SECRET)
    register_secrets(environ={"MY_SERVICE_TOKEN": SECRET})
    tag = f"+logger.mlflow.tags.db=postgresql://bob:{TAG_PASSWORD}@db.example.com/x"  # a secret by its shape
    jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJtbGZsb3cifQ.bWxmbG93LXRhZy1zaWduYXR1cmUtOWQ0ZQ"  # a token by its format
    cfg = compose_cfg(
        "logger=mlflow",
        "experiment_name=trackers",
        "logger.wandb.api_key=${oc.env:MY_SERVICE_TOKEN}",
        tag,
        f"+logger.mlflow.tags.session={jwt}",
    )
    (tmp_path / "outputs").mkdir()
    shutil.copy(migrated_mlflow_db, tmp_path / "outputs" / "mlflow.db")
    first = MlflowRun(cfg.logger.mlflow, TrackedRun.of(cfg, tmp_path), run_id=None, start_step=0)
    for step in (1, 2, 3):
        first.log({"train/loss": 1.0 / step, "train/mfu": None}, step)
    first.table("eval/generations", [{"prompt": "p", "completion": "c"}], 3)
    first.artifact("summary.json", {"status": "stopped", "steps": 3})
    first.close(RunStatus.STOPPED)
    uri = default_tracking_uri()
    assert uri == f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}"
    (run,) = mlflow_runs(uri)
    assert (run.info.status, run.info.run_name) == ("KILLED", tmp_path.name)
    assert run.data.params["experiment_name"] == "trackers" and run.data.params["logger.wandb.api_key"] == "<redacted>"
    assert (
        run.data.tags["db"]
        == run.data.params["logger.mlflow.tags.db"]
        == "postgresql://bob:<redacted>@db.example.com/x"
    )
    assert run.data.tags["session"] == run.data.params["logger.mlflow.tags.session"] == "<redacted>"

    resumed_cfg = compose_cfg("logger=mlflow", "experiment_name=trackers", "train.max_steps=6")
    resumed = MlflowRun(
        resumed_cfg.logger.mlflow, TrackedRun.of(resumed_cfg, tmp_path), run_id=first.run_id, start_step=3
    )
    assert resumed.run_id == first.run_id
    for step in (4, 5, 6):
        resumed.log({"train/loss": 1.0 / step}, step)
    resumed.artifact("summary.json", {"status": "completed", "steps": 6})
    resumed.close(RunStatus.COMPLETED)
    (run,) = mlflow_runs(uri)
    assert run.info.status == "FINISHED" and run.data.tags["ds_exp.status"] == "completed"
    assert [s for s, _ in history(uri, run.info.run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert "train.max_steps: -1 -> 6" in run.data.tags["ds_exp.changed_at_step_3"]  # params never change in MLflow
    artifacts = tmp_path / "outputs" / "mlartifacts" / run.info.run_id / "artifacts"
    assert json.loads((artifacts / "summary.json").read_text())["steps"] == 6
    assert (artifacts / "eval" / "generations" / "step000003.json").is_file()
    assert files_holding(tmp_path, [SECRET, TAG_PASSWORD]) == {}

    # a hard kill after the checkpoint at step 5 (steps 6 logged twice): said in a tag, as MLflow cannot delete
    again = MlflowRun(
        resumed_cfg.logger.mlflow, TrackedRun.of(resumed_cfg, tmp_path), run_id=first.run_id, start_step=5
    )
    again.log({"train/loss": 0.5}, 6)
    again.close(RunStatus.COMPLETED)
    (run,) = mlflow_runs(uri)
    assert "steps 6..6 come from an attempt killed" in run.data.tags["ds_exp.resumed_at_step_5"]

    other_rank = Trackers(
        cfg.logger, TrackedRun.of(cfg, tmp_path / "rank1"), enabled=False, start=TrainState(trackers={"mlflow": "x"})
    )
    assert other_rank.all == [] and other_rank.ids() == {"mlflow": "x"}  # kept for the checkpoints it writes
    assert not (tmp_path / "rank1").exists()

    bogus = compose_cfg("logger=mlflow", "logger.mlflow.tracking_uri=bogus://x")
    with pytest.raises(RunFailed, match=r"logger.mlflow: MLflow refused the tracking store bogus://x \(.*unsupported"):
        MlflowRun(bogus.logger.mlflow, TrackedRun.of(bogus, tmp_path), run_id=None, start_step=0)

    # a server gone after the run's checks (nothing listens on 127.0.0.1:9): seconds, announced, not MLflow's 246 s
    # of retries; a password too short to be registered as a secret is still not shown (issue 31 §3)
    monkeypatch.setattr(waits, "NOTICE_S", 1.0)
    gone = compose_cfg("logger=mlflow", "logger.mlflow.tracking_uri=http://ds:pw@127.0.0.1:9")
    started = time.monotonic()
    with pytest.raises(RunFailed) as refused:
        MlflowRun(gone.logger.mlflow, TrackedRun.of(gone, tmp_path), run_id=None, start_step=0)
    assert time.monotonic() - started < 30
    assert str(refused.value).startswith("logger.mlflow: MLflow refused the tracking store http://ds:***@127.0.0.1:9")
    assert "ds:pw@" not in str(refused.value)
    assert "ds_exp: waiting for the MLflow server http://ds:***@127.0.0.1:9 since " in capsys.readouterr().err


@pytest.mark.slow  # MLflow's import and its SQLite store's first migration take seconds
def test_runs_that_open_the_projects_mlflow_store_at_once_each_log_to_it(compose_cfg, tmp_path, monkeypatch):
    """One store per project (issue 35 §3), so runs meet in it: three that open a new one at the same moment (a
    sweep's jobs on SLURM, two terminals) each get their own MLflow run with every step. MLflow creates a store's
    tables on its first use, and processes doing that at once failed ("duplicate column name"): ds_exp opens a store
    one process at a time (ds_exp.artifacts.trackers.mlflow.store_opened)."""
    import multiprocessing

    import mlflow  # noqa: F401  # imported once, before the runs are forked

    from ds_exp.artifacts.trackers.mlflow import MlflowRun, default_tracking_uri

    monkeypatch.chdir(tmp_path)
    cfg = compose_cfg("logger=mlflow", "experiment_name=together")
    fork = multiprocessing.get_context("fork")
    go = fork.Event()

    def run(name: str) -> None:
        go.wait()
        tracker = MlflowRun(
            cfg.logger.mlflow,
            TrackedRun.of(cfg, tmp_path / "outputs" / "multirun" / "together" / name),
            run_id=None,
            start_step=0,
        )
        for step in range(1, 11):
            tracker.log({"train/loss": 1.0 / step}, step)
        tracker.artifact("summary.json", {"status": "completed", "steps": 10})
        tracker.close(RunStatus.COMPLETED)

    runs = [fork.Process(target=run, args=(str(n),)) for n in range(3)]  # a sweep's jobs 0, 1, 2
    for process in runs:
        process.start()
    go.set()
    for process in runs:
        process.join(timeout=300)
    assert [process.exitcode for process in runs] == [0, 0, 0]
    uri = default_tracking_uri()
    found = sorted(mlflow_runs(uri), key=lambda r: r.info.run_name)
    # named by their directories under outputs/: the jobs of another sweep in the same store are other names
    assert [(r.info.run_name, r.info.status) for r in found] == [(f"multirun/together/{n}", "FINISHED") for n in "012"]
    assert all([s for s, _ in history(uri, r.info.run_id, "train/loss")] == list(range(1, 11)) for r in found)


@pytest.mark.slow
def test_wandb_tensorboard_and_mlflow_at_once_on_two_ranks_and_a_resume(tmp_path, cache_dir):
    """One 2-rank run to step 4 with every tracker, resumed (same directory, resume=auto) to step 8: each tracker
    holds what metrics.jsonl holds, each step once, in one MLflow run; rank 1 writes nothing of its own; no secret
    in any of it."""
    run_dir = tmp_path / "run"
    common = [
        *FAST,
        "scheduler=constant",
        "train.save_final_checkpoint=true",
        "logger=[wandb,tensorboard,mlflow]",
        "logger.wandb.mode=offline",
        f"logger.wandb.api_key={SECRET}",
    ]
    env = {"WANDB_MODE": "offline", "HF_TOKEN": SECRET + "-hf"}
    first = launch(run_dir, *common, "train.max_steps=4", launcher="ranks", nproc=2, cache_dir=cache_dir, env=env)
    assert first.ok, first.explain()
    resumed = launch(
        run_dir, *common, "train.max_steps=8", "resume=auto", launcher="ranks", nproc=2, cache_dir=cache_dir, env=env
    )
    assert resumed.ok, resumed.explain()
    lines = resumed.records("train")
    assert [r["step"] for r in lines] == list(range(1, 9))
    expected = [(r["step"], r["loss"]) for r in lines]

    tensorboard = scalars(run_dir / "tensorboard", "train/loss")
    assert [s for s, _ in tensorboard] == [s for s, _ in expected]
    assert all(math.isclose(a, b, rel_tol=1e-6) for (_, a), (_, b) in zip(tensorboard, expected, strict=True))
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one writer per attempt, rank 0

    uri = f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}"  # the project's store, where the run was launched
    (run,) = mlflow_runs(uri)  # one run, continued
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    logged = history(uri, run.info.run_id, "train/loss")
    assert [s for s, _ in logged] == [s for s, _ in expected]
    assert all(math.isclose(a, b, rel_tol=1e-6) for (_, a), (_, b) in zip(logged, expected, strict=True))
    final = resumed.records("eval")[-1]
    assert math.isclose(dict(history(uri, run.info.run_id, "eval/perplexity"))[8], final["perplexity"], rel_tol=1e-6)
    marker = json.loads((run_dir / "checkpoints" / "step8" / "ds_exp_complete.json").read_text())
    assert marker["trackers"]["mlflow"] == run.info.run_id and marker["trackers"]["wandb"]  # one mapping (issue 34)
    assert not {"mlflow_run_id", "wandb_run_id"} & set(marker)
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files_holding(run_dir, [SECRET]) == {} and files_holding(tmp_path / "outputs", [SECRET]) == {}
    assert SECRET not in first.proc.stdout + first.proc.stderr + resumed.proc.stdout + resumed.proc.stderr
