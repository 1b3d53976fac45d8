"""An experiment is a file: every preset names its runs (output and sweep directories, the optuna study, the wandb
group through experiment_name), so does a user's own file given with --config-dir, and `--write-experiment`
saves a command line as such a file that composes to exactly the same config."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from ds_exp.config.paths import conf_dir
from ds_exp.config.schema import to_config
from ds_exp.config.secrets import register_secrets
from ds_exp.core.errors import ConfigError
from ds_exp.launch.cli import unnamed_experiment_note
from ds_exp.launch.experiment_file import write_experiment_main
from ds_exp.sweeps.jobs import sweep_jobs
from tests.conftest import run_cli

PRESETS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


def composed(*overrides: str, config_dir: Path | None = None):
    """Hydra's config with its hydra node (run and sweep directories), as `python -m ds_exp [--config-dir]`."""
    search = [f"hydra.searchpath=[file://{config_dir}]"] if config_dir else []
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=[*overrides, *search], return_hydra_config=True)


def names_of(cfg) -> dict[str, str]:
    """What a run is named by: experiment_name and the directories and study it resolves into."""
    return {
        "experiment_name": cfg.experiment_name,
        "run dir": str(cfg.hydra.run.dir).split("/")[1],
        "sweep dir": str(cfg.hydra.sweep.dir).split("/")[2],
    }


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_names_its_runs(preset):
    """`_self_` last in conf/config.yaml made every preset's experiment_name `default`."""
    cfg = composed(f"experiment={preset}")
    assert names_of(cfg) == {"experiment_name": preset, "run dir": preset, "sweep dir": preset}
    if preset != "autotune":  # autotune brings its own sweeper; any other sweep may be an optuna study
        study = composed(f"experiment={preset}", "hydra/sweeper=optuna")
        name = study.hydra.sweeper.study_name  # the experiment and a digest of the search (none here)
        assert name.startswith(f"{preset}-") and str(study.hydra.sweep.dir) == f"outputs/optuna/{name}"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_users_own_experiment_file_names_its_runs(tmp_path):
    _write(
        tmp_path / "experiment" / "mine.yaml",
        "# @package _global_\ndefaults:\n  - override /zero: stage2\nexperiment_name: mine\ntrain:\n  max_steps: 3\n",
    )
    cfg = composed("experiment=mine", config_dir=tmp_path)
    assert names_of(cfg) == {"experiment_name": "mine", "run dir": "mine", "sweep dir": "mine"}
    assert cfg.zero.stage == 2 and cfg.train.max_steps == 3

    # a file that names nothing runs as `default`, and the run says how to name it
    _write(tmp_path / "experiment" / "unnamed.yaml", "# @package _global_\ntrain:\n  max_steps: 3\n")
    unnamed = composed("experiment=unnamed", config_dir=tmp_path)
    HydraConfig.instance().set_config(unnamed)
    try:
        assert "add `experiment_name: unnamed` to its file" in unnamed_experiment_note(unnamed.experiment_name)
        assert unnamed_experiment_note("mine") is None
    finally:
        HydraConfig.instance().cfg = None


COMMAND_LINES = [
    [
        "zero=stage3",
        "lora.dim=64",
        "data.data_split='10,0,0'",
        'eval.prompts=[hello world, "a, b"]',
        "optimizer.lr=3e-5",
    ],
    ["experiment=dschat_step1", "data=dschat_local", "data.sources.0.path=/data/dschat", "precision=bf16"],
    [
        "scheduler=warmup_stable_decay",
        "scheduler.kwargs.min_lr_ratio=0.1",
        "model.arch.hidden_size=64",
        "offload=cpu",
        "zero=stage2",
        "hydra/launcher=local",
        "hydra.launcher.tasks_per_node=2",
        "experiment_name=my_name",
    ],
]


@pytest.mark.parametrize("args", COMMAND_LINES, ids=["values", "preset+list item", "hydra+name"])
def test_the_written_file_composes_to_the_command_lines_config(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert write_experiment_main(["--write-experiment", "exps/exp.yaml", *args]) == 0
    path = tmp_path / "exps" / "experiment" / "exp.yaml"
    text = path.read_text()
    assert text.startswith("# @package _global_\n")
    assert f"python -m ds_exp --config-dir {tmp_path / 'exps'} experiment=exp" in text  # how to run it
    assert "Sweep it:  python -m ds_exp -m --config-dir" in text
    name = next((a.split("=", 1)[1] for a in args if a.startswith("experiment_name=")), "exp")
    from_file = composed("experiment=exp", config_dir=tmp_path / "exps")
    from_line = composed(*args, *([] if name != "exp" else ["experiment_name=exp"]))
    assert to_config(from_file) == to_config(from_line)  # the typed configs a run trains with
    assert from_file.hydra.launcher == from_line.hydra.launcher
    assert from_file.experiment_name == name
    body = yaml.safe_load(text)
    groups = [a for a in args if re.match(r"^[\w/]+=", a) and "." not in a.split("=")[0]]
    for group_choice in groups:  # group choices are in the defaults list, as overrides of the root's
        key, option = group_choice.split("=")
        if key == "experiment":
            assert f"/experiment/{option}" in body["defaults"]
        elif key != "experiment_name":
            assert {f"override /{key}": option} in body["defaults"]
    if "eval" in body:  # values are YAML: a list is a list, the quoted string plain
        assert body["eval"]["prompts"] == ["hello world", "a, b"] and body["data"]["data_split"] == "10,0,0"
    if "experiment=dschat_step1" in args:  # an item of a list: the whole list, each item what differs from a source's
        # defaults (issue 41 §10: not DataSource's 11 fields)
        assert body["data"]["sources"] == [{"path": "/data/dschat", "format": "dschat", "layout": "prompt_chosen"}]


def test_sweeps_go_under_hydra_sweeper_params(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_experiment_main(["--write-experiment", "sw", "-m", "zero=stage0,stage1", "optimizer.lr=1e-4,3e-4"])
    path = tmp_path / "experiment" / "sw.yaml"
    assert yaml.safe_load(path.read_text())["hydra"]["sweeper"]["params"] == {
        "zero": "stage0,stage1",
        "optimizer.lr": "1e-4,3e-4",
    }
    assert f"Run it:    python -m ds_exp -m --config-dir {tmp_path} experiment=sw" in path.read_text()
    jobs = sweep_jobs(composed("experiment=sw", config_dir=tmp_path))
    assert len(jobs) == 4 and ["zero=stage1", "optimizer.lr=0.0003", "experiment=sw"] in jobs


def test_an_existing_file_is_never_overwritten(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path / "experiment" / "mine.yaml", "# my own work\n")
    with pytest.raises(ConfigError, match="already exists; nothing was written"):
        write_experiment_main(["--write-experiment", "mine.yaml", "zero=stage3"])
    assert path.read_text() == "# my own work\n"


def test_credentials_are_never_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    secret = "sk-the-real-key-123456"
    write_experiment_main(["--write-experiment", "w", "logger=wandb", f"logger.wandb.api_key={secret}"])
    text = (tmp_path / "experiment" / "w.yaml").read_text()
    assert secret not in text and "api_key" not in text
    assert "left out:  logger.wandb.api_key (a credential)" in capsys.readouterr().out
    # a reference to the environment is not a credential: it is kept
    write_experiment_main(["--write-experiment", "ref", "logger=wandb", "logger.wandb.api_key=${oc.env:MY_KEY}"])
    assert yaml.safe_load((tmp_path / "experiment" / "ref.yaml").read_text())["logger"] == {
        "wandb": {"api_key": "${oc.env:MY_KEY}"}
    }
    # secrets by their shape or their place (issue 31 §4) are left out too, named; the rest is written
    shaped = "postgresql://bob:shape-pw-2b7e@db.example.com/x"
    write_experiment_main(
        ["--write-experiment", "shapes", f"+logger.mlflow.tags.db={shaped}", "+hydra.job.env_set.UPLOAD=up-4c1f9a"]
    )
    text, out = (tmp_path / "experiment" / "shapes.yaml").read_text(), capsys.readouterr().out
    assert "shape-pw-2b7e" not in text and "up-4c1f9a" not in text and "experiment_name: shapes" in text
    assert "left out:  logger.mlflow.tags.db (its value holds a password in a URL)" in out
    assert "left out:  hydra.job.env_set.UPLOAD (a variable of the job's environment" in out
    # an environment credential under an innocent key: nothing is written
    monkeypatch.setenv("HF_TOKEN", "hf_env_token_abcdef")
    register_secrets(environ={"HF_TOKEN": "hf_env_token_abcdef"})
    with pytest.raises(ConfigError, match="is a credential"):
        write_experiment_main(["--write-experiment", "leak", "logger=wandb", "logger.wandb.entity=hf_env_token_abcdef"])
    assert not (tmp_path / "experiment" / "leak.yaml").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--write-experiment", "zero_sweep.yaml", "zero=stage3"], "is the name of a ds_exp preset"),
        (["--write-experiment", "my exp.yaml"], "cannot be an experiment name"),
        (["--write-experiment", "x.yaml", "~train.seed"], "cannot delete a key"),
        (["--write-experiment", "x.yaml", "--cfg", "job"], "takes overrides"),
        (["--write-experiment", "x.yaml", "zero=stage9"], "does not compose"),
    ],
)
def test_what_a_file_cannot_hold_is_one_message(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        write_experiment_main(args)
    assert not (tmp_path / "experiment").exists() or not any((tmp_path / "experiment").iterdir())


@pytest.mark.slow
def test_write_then_run_the_file_from_the_command_line(tmp_path):
    """Through the CLI as a user types it: write, then `--config-dir DIR experiment=NAME` prints the same config
    as the original command line and runs into outputs/NAME/."""
    args = ["zero=stage3", "lora.dim=64", "data.data_split='10,0,0'"]  # the README's
    written = run_cli("--write-experiment", "exps/my_exp.yaml", *args, cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    assert f"run it:    python -m ds_exp --config-dir {tmp_path / 'exps'} experiment=my_exp" in written.stdout
    from_file = run_cli("--config-dir", "exps", "experiment=my_exp", "--cfg", "job", cwd=tmp_path)
    from_line = run_cli(*args, "experiment_name=my_exp", "--cfg", "job", cwd=tmp_path)
    assert from_file.returncode == 0 and from_file.stdout == from_line.stdout, from_file.stderr
    dry = run_cli("--config-dir", "exps", "experiment=my_exp", "dry_run=true", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    (run_dir,) = (tmp_path / "outputs" / "my_exp").iterdir()
    assert OmegaConf.load(run_dir / ".hydra" / "config.yaml").experiment_name == "my_exp"


# ---------------------------------------------------------------- issue 31 §6: as safe as the command line


@pytest.fixture
def small_disk(tmp_path):
    """mount(options) mounts a 64 KiB tmpfs (root only: skipped where mounting is not permitted); unmounted after."""
    point = tmp_path / "disk"
    point.mkdir()
    mounted: list[Path] = []

    def mount(*options: str) -> Path:
        if mounted:
            subprocess.run(["umount", str(point)], check=True)
            mounted.clear()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", ",".join(["size=64k", *options]), "tmpfs", str(point)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    if mounted:
        subprocess.run(["umount", str(point)], check=True)


def test_write_experiment_onto_a_read_only_or_full_disk_writes_nothing(small_disk, tmp_path, monkeypatch, capsys):
    """One message, exit 2, no traceback, and neither a partial file nor the directories made for it."""
    monkeypatch.chdir(tmp_path)
    disk = small_disk("ro")
    with pytest.raises(ConfigError, match="is on a read-only file system"):
        write_experiment_main(["--write-experiment", str(disk / "mine.yaml"), "zero=stage3"])
    disk = small_disk()
    (disk / "fill").write_bytes(b"\0" * 62 * 1024)  # room for a directory or two, not for the file
    with pytest.raises(ConfigError, match=r"cannot be written \(No space left on device\); nothing was written"):
        write_experiment_main(["--write-experiment", str(disk / "sub" / "mine.yaml"), "zero=stage3"])
    assert sorted(p.name for p in disk.rglob("*")) == ["fill"]
    # through the command's own main (launch/cli.py, inside the error boundary): one line, exit 2, no traceback
    from ds_exp.launch import cli

    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["ds_exp", "--write-experiment", str(disk / "mine.yaml"), "zero=stage3"])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("ds_exp: error: --write-experiment") and len(err.splitlines()) == 1
    assert sorted(p.name for p in disk.rglob("*")) == ["fill"]


def test_an_experiment_name_holding_a_path_puts_nothing_outside_outputs(tmp_path, monkeypatch):
    """outputs/${experiment_name}/<time>: `../../away` put the run beside the project; refused before anything is
    made, where the run would have gone too."""
    from ds_exp.launch.run_dir import check_run_start

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    config = composed("experiment_name=../../away")
    with pytest.raises(ConfigError, match=r"experiment_name=\.\./\.\./away is not a plain name"):
        check_run_start(config)
    assert sorted(tmp_path.rglob("*")) == [project]


def test_an_experiment_files_defaults_are_checked_where_they_lead(tmp_path):
    """What a chosen file includes in the user's directory is checked too; ds_exp's presets are found first."""
    from ds_exp.config.config_files import check_config_files

    _write(tmp_path / "experiment" / "top.yaml", "# @package _global_\ndefaults:\n  - /experiment/autotune\n  - low\n")
    _write(tmp_path / "experiment" / "low.yaml", "# @package _global_\ntrain: {max_steps: [1,\n")
    with pytest.raises(ConfigError, match=r"low.yaml: not valid YAML at line 3"):
        check_config_files(["--config-dir", str(tmp_path), "experiment=top"])
    _write(tmp_path / "experiment" / "low.yaml", "# @package _global_\ntrain: {max_steps: 2}\n")
    _write(tmp_path / "zero" / "mine.yaml", "stage: 3\nstage: 2\n")  # a group's own file: no header needed
    check_config_files([f"hydra.searchpath=[file://{tmp_path}]", "experiment=top"])
    with pytest.raises(ConfigError, match="`stage` is given twice"):
        check_config_files([f"hydra.searchpath=[file://{tmp_path}]", "experiment=top", "zero=stage0,mine"])
