"""The trackers as components (issue 34): the table owns each tracker's facts (its settings, YAML, module and extra),
a package left out of the install is one line naming its extra before anything heavy, and a checkpoint's marker
keeps the trackers' run ids as one mapping, markers written by earlier versions still read.
tests/integration/test_trackers.py builds every entry."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_exp.artifacts.trackers.base import TrackedRun
from ds_exp.artifacts.tracking import Trackers
from ds_exp.config.trackers import TRACKERS, LoggerConfig
from ds_exp.core.status import RunStatus
from ds_exp.resume.store import COMPLETE_MARKER, TrainState, read_marker
from tests.training import user_env

REPO = Path(__file__).resolve().parents[2]


def test_each_tracker_entry_owns_its_settings_yaml_module_and_extra():
    import tomllib  # Python 3.11

    fields = {f.name: f for f in dataclasses.fields(LoggerConfig)}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    (everything,) = [r for r in extras["dev"] if r.startswith("ds_exp[")]
    readme = (REPO / "README.md").read_text()
    for name, entry in TRACKERS.items():
        assert fields[name].default_factory is entry.settings, name  # logger.<name>: its settings
        assert (REPO / "conf" / "logger" / f"{name}.yaml").is_file(), name
        module = entry.builder.partition(":")[0]
        assert (REPO / f"{module.replace('.', '/')}.py").is_file(), entry.builder
        if entry.extra is None:  # a dependency of ds_exp itself (the mission's: wandb)
            assert any(r.startswith(entry.packages[0]) for r in project["dependencies"]), name
        else:  # an extra, in `dev` (CI installs every path), and in README's tracker list
            assert entry.extra in extras and entry.extra in everything, name
            assert f'pip install "ds_exp[{entry.extra}]"' in readme, name


def test_a_marker_keeps_the_trackers_run_ids_as_one_mapping_and_old_markers_still_read(compose_cfg, tmp_path):
    """A marker as ds_exp wrote it before issue 34 (one field per tracker): a resume reads its ids into the mapping,
    continues those runs, and writes the new shape; a tracker this attempt does not turn on keeps its run's id."""
    old = {
        "step": 4,
        "epoch": 0,
        "step_in_epoch": 4,
        "wandb_run_id": "wandb-7f3a",
        "mlflow_run_id": "5d1c0e",
        "window_loss_sum": 0.0,
        "window_label_tokens": 0.0,
        "initial_eval": {"eval_loss": 2.5},
        "trajectory": None,
        "run_id": "run-1",
        "branch": "branch-1",
        "run_dir": str(tmp_path),
        "settings": None,
        "model_config": None,
    }
    tag = tmp_path / "checkpoints" / "step4"
    tag.mkdir(parents=True)
    (tag / COMPLETE_MARKER).write_text(json.dumps(old))
    state = TrainState(**read_marker(tag))  # as the checkpointer and the universal loader read a marker
    assert state.trackers == {"wandb": "wandb-7f3a", "mlflow": "5d1c0e"} and state.step == 4
    written = json.loads(json.dumps(state.as_dict()))
    assert written["trackers"] == state.trackers and not {"wandb_run_id", "mlflow_run_id"} & set(written)
    assert TrainState(**written) == state
    assert TrainState(**{**old, "mlflow_run_id": None}).trackers == {"wandb": "wandb-7f3a"}  # a run without MLflow

    # resumed with TensorBoard only: nothing to continue there, and the others' ids stay for the next checkpoints
    cfg = compose_cfg("logger=tensorboard")
    trackers = Trackers(cfg.logger, TrackedRun.of(cfg, tmp_path), enabled=True, start=state)
    assert [t.name for t in trackers.all] == ["TensorBoard"]
    assert trackers.ids() == {"mlflow": "5d1c0e", "wandb": "wandb-7f3a"}
    trackers.close(RunStatus.COMPLETED)


# Python started with some packages not installed, as far as the import system can tell (find_spec and import),
# then `python -m ds_exp ARGS`
WITHOUT = """
import importlib.machinery, sys
hidden = set(sys.argv.pop(1).split(","))
class NotInstalled(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in hidden else super().find_spec(name, path, target)
sys.meta_path[:] = [NotInstalled if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
sys.argv[0] = "ds_exp"
from ds_exp.launch.cli import main
main()
"""


@pytest.mark.parametrize(
    ("hidden", "args", "expected"),
    [
        (
            "mlflow,tensorboardX",
            ["logger=[wandb,tensorboard,mlflow]", "logger.wandb.mode=offline"],
            [
                'logger=mlflow needs mlflow, which is not installed: pip install "ds_exp[mlflow]"',
                'logger=tensorboard needs tensorboardX, which is not installed: pip install "ds_exp[tensorboard]"',
            ],
        ),
        (
            "optuna",
            ["-m", "hydra/sweeper=optuna", "optimizer.lr=interval(1e-5,1e-3)"],
            ['hydra/sweeper=optuna needs optuna, which is not installed: pip install "ds_exp[optuna]"'],
        ),
    ],
    ids=["trackers", "optuna"],
)
def test_a_package_left_out_of_the_install_is_one_line_naming_its_extra(tmp_path, hidden, args, expected):
    """Before anything heavy: the tracker's checks (validation) and the sweeper (when Hydra instantiates it) look
    the package up; nothing imports it first (it would fail: the package is not there)."""
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT, hidden, *args, f"hydra.run.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/c"],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("ds_exp: error: "), proc.stderr
    assert sorted([lines[0].removeprefix("ds_exp: error: "), *lines[1:]]) == sorted(expected), proc.stderr


def test_an_mlflow_run_says_how_to_look_at_it_and_what_to_install_for_that(monkeypatch):
    """`.[mlflow]` logs through mlflow-skinny, whose `mlflow ui` fails with flask's ImportError: the run's line
    names the command, and `pip install mlflow` first where only the extra is installed (issue 41 §6)."""
    import importlib.metadata

    from ds_exp.artifacts.trackers.mlflow import viewer_line

    def only(installed: set[str]):
        def distribution(name: str) -> object:
            if name not in installed:
                raise importlib.metadata.PackageNotFoundError(name)
            return object()

        return distribution

    store = "sqlite:////home/me/outputs/mlflow.db"
    monkeypatch.setattr(importlib.metadata, "distribution", only({"mlflow-skinny"}))
    assert viewer_line(store) == f"; to look at it: pip install mlflow, then mlflow ui --backend-store-uri {store}"
    monkeypatch.setattr(importlib.metadata, "distribution", only({"mlflow-skinny", "mlflow"}))
    assert viewer_line(store) == f"; to look at it: mlflow ui --backend-store-uri {store}"
