"""A checkpoint directory holds one trajectory, and a conversion belongs to exactly one checkpoint: the mechanisms
in-process, on real files (a fake engine writes the checkpoint files; ds_exp.checkpoint.save and
ds_exp.universal run as they are). tests/integration/test_resume_guards.py and
tests/integration/test_resume_anywhere.py show them in runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_exp.checkpoint import universal
from ds_exp.checkpoint.checkpointer import save
from ds_exp.core.errors import ResumeError, RunFailed
from ds_exp.resume.branches import set_aside_branch
from ds_exp.resume.store import BRANCHES, COMPLETE_MARKER, LATEST, TrainState
from tests.training import user_env


@pytest.fixture
def one_rank(tmp_path):
    """A real gloo process group of one rank (save() makes real collectives)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class FilesEngine:
    """What save() asks of a DeepSpeed engine: a model states file holding the client state."""

    def save_checkpoint(self, directory: str, tag: str, client_state: dict, save_latest: bool) -> None:
        assert not save_latest  # ds_exp writes `latest` itself, once the checkpoint is complete
        path = Path(directory) / tag
        path.mkdir(parents=True, exist_ok=True)
        (path / "mp_rank_00_model_states.pt").write_text(json.dumps(client_state))


def checkpoint(directory: Path, step: int, **marker) -> Path:
    """A complete checkpoint as save() leaves it (its marker last)."""
    tag_dir = directory / f"step{step}"
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_text(f"weights of step {step}, {marker.get('branch')}")
    (tag_dir / COMPLETE_MARKER).write_text(json.dumps({"step": step, **marker}))
    return tag_dir


def contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def state(run_dir: Path, step: int, branch: str, run_id: str = "A") -> TrainState:
    return TrainState(step=step, run_id=run_id, branch=branch, run_dir=str(run_dir.resolve()))


def test_a_resume_from_an_older_step_sets_the_later_ones_aside_and_saves_anew(tmp_path, one_rank):
    """The issue's sequence (keep_last 2 to step 8, then keep_last 1 from step 6): nothing of the first branch is
    deleted or kept as the newest, the checkpoint just written is never rotated away, `latest` always names a complete
    checkpoint, and step 8 is saved again (not "complete already") with the new branch's weights."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    checkpoint(ckpts, 6, run_id="A", branch="first")
    old8 = checkpoint(ckpts, 8, run_id="A", branch="first")
    (ckpts / "step8.universal").mkdir()
    (ckpts / "step8.universal" / "x").write_text("its conversion")
    (ckpts / "step9").mkdir()  # a save killed before its marker
    (ckpts / LATEST).write_text("step8")
    first_branch = contents(old8) | {"step8.universal/x": b"its conversion"}

    aside = set_aside_branch(ckpts, ckpts / "step6", run_dir)
    moved, names = aside.branch, aside.checkpoints
    assert names == ["step8"] and moved is not None and moved.parent == ckpts / BRANCHES
    assert moved.name.endswith("-resumed-at-step6")
    assert sorted(p.name for p in moved.iterdir()) == ["step8", "step8.universal", "step9"]
    assert {k: v for k, v in contents(moved).items() if not k.startswith("step9")} == {
        (k if k.startswith("step8.universal") else f"step8/{k}"): v for k, v in first_branch.items()
    }
    assert (ckpts / LATEST).read_text() == "step6"  # the moved step8 is not named any more
    assert sorted(p.name for p in ckpts.iterdir()) == [BRANCHES, LATEST, "step6"]

    for step in (7, 8):
        save(FilesEngine(), ckpts, state(run_dir, step, "second"), rank=0, keep_last=1)
        assert (ckpts / LATEST).read_text() == f"step{step}"
        assert (ckpts / f"step{step}" / COMPLETE_MARKER).is_file()  # the one just written survives its rotation
        assert sorted(p.name for p in ckpts.glob("step*")) == [f"step{step}"]
    saved = json.loads((ckpts / "step8" / "mp_rank_00_model_states.pt").read_text())
    assert saved["ds_exp"]["branch"] == "second"  # the new weights, not the first branch's
    assert json.loads((moved / "step8" / COMPLETE_MARKER).read_text())["branch"] == "first"


def test_a_checkpoint_of_another_branch_at_the_step_is_set_aside_at_save_and_its_own_is_not_saved_twice(
    tmp_path, one_rank
):
    """Left by an older ds_exp (no set-aside at resume): the save sets it aside instead of skipping; a checkpoint of
    this very branch at the step holds these weights, so it is kept; another run's (shared directory) is refused."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    checkpoint(ckpts, 4, run_id="A")  # no branch recorded
    save(FilesEngine(), ckpts, state(run_dir, 4, "new"), rank=0, keep_last=0)
    assert json.loads((ckpts / "step4" / COMPLETE_MARKER).read_text())["branch"] == "new"
    (aside,) = (ckpts / BRANCHES).iterdir()
    assert json.loads((aside / "step4" / COMPLETE_MARKER).read_text()) == {"step": 4, "run_id": "A"}

    before = contents(ckpts)
    save(FilesEngine(), ckpts, state(run_dir, 4, "new"), rank=0, keep_last=0)  # the same branch and step
    assert contents(ckpts) == before

    shared = tmp_path / "shared"  # outside the run directory (train.allow_outside_run_dir)
    checkpoint(shared, 2, run_id="B", branch="theirs", run_dir=str(tmp_path / "other"))
    with pytest.raises(RunFailed, match="a complete checkpoint of another run"):
        save(FilesEngine(), shared, state(run_dir, 2, "new"), rank=0, keep_last=1)
    save(FilesEngine(), shared, state(run_dir, 3, "new"), rank=0, keep_last=1)
    assert sorted(p.name for p in shared.glob("step*")) == ["step2", "step3"]  # rotation leaves theirs


def test_a_resume_from_another_directory_sets_this_directorys_checkpoints_aside_and_touches_nothing_there(tmp_path):
    other = tmp_path / "other" / "checkpoints"
    source = checkpoint(other, 6, run_id="A", branch="a", run_dir=str((tmp_path / "other").resolve()))
    theirs = contents(other.parent)
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    checkpoint(ckpts, 2, run_id="B", branch="b")
    checkpoint(ckpts, 8, run_id="B", branch="b")
    (ckpts / LATEST).write_text("step8")
    aside = set_aside_branch(ckpts, source, run_dir)
    moved, names = aside.branch, aside.checkpoints
    assert names == ["step2", "step8"] and moved is not None
    assert not (ckpts / LATEST).exists()  # nothing complete is left for it to name
    assert contents(other.parent) == theirs

    shared = tmp_path / "shared"  # a checkpoint directory outside both run directories: only this run's move
    checkpoint(shared, 8, run_id="C", branch="c", run_dir=str((tmp_path / "third").resolve()))
    checkpoint(shared, 10, run_id="B", branch="b", run_dir=str(run_dir.resolve()))
    aside = set_aside_branch(shared, source, run_dir)
    moved, names = aside.branch, aside.checkpoints
    assert names == ["step10"] and (shared / "step8").is_dir()


def test_a_conversion_is_used_only_for_the_exact_checkpoint_it_came_from(tmp_path):
    ckpts = tmp_path / "checkpoints"
    tag_dir = checkpoint(ckpts, 4, run_id="A", branch="first")
    udir = universal.universal_dir(tag_dir)
    assert universal.conversion_status(tag_dir) == (False, None)
    udir.mkdir()
    assert "incomplete" in universal.conversion_status(tag_dir)[1]
    (udir / universal.MARKER).write_text(json.dumps({"source": str(tag_dir)}))  # an older ds_exp's
    assert "records no fingerprint" in universal.conversion_status(tag_dir)[1]
    found = universal.fingerprint(tag_dir)
    marker = {"source_fingerprint": found["digest"], "source_files": found["files"]}
    (udir / universal.MARKER).write_text(json.dumps(marker))
    assert universal.conversion_status(tag_dir) == (True, None)

    moved = tmp_path / "moved"  # renamed with its checkpoint (a branch set aside): still its conversion
    moved.mkdir()
    os.replace(tag_dir, moved / "step4")
    os.replace(udir, moved / "step4.universal")
    assert universal.is_converted(moved / "step4")

    tag_dir = moved / "step4"  # the step rewritten by another branch: same names and sizes, other marker
    weights = tag_dir / "mp_rank_00_model_states.pt"
    weights.write_text(weights.read_text().replace("first", "other"))
    usable, why = universal.conversion_status(tag_dir)
    assert not usable and f"{tag_dir} changed since it was converted (mp_rank_00_model_states.pt)" in why


def test_incomplete_checkpoints_are_never_converted(tmp_path):
    ckpts = tmp_path / "checkpoints"
    checkpoint(ckpts, 2)
    no_marker = ckpts / "step4"
    no_marker.mkdir()
    (no_marker / "mp_rank_00_model_states.pt").write_text("half written")
    empty = checkpoint(ckpts, 6)
    (empty / COMPLETE_MARKER).write_text("")
    for tag_dir, why in ((no_marker, "it has no ds_exp_complete.json"), (empty, "is empty or unreadable")):
        with pytest.raises(ResumeError, match=why) as err:
            universal.convert_here(tag_dir)
        assert f"the newest complete checkpoint beside it is {ckpts / 'step2'}" in str(err.value)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step2", "step4", "step6"]  # nothing converted or left


def test_a_temporary_conversion_of_a_dead_process_is_removed_by_the_next(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    leftover = tmp_path / f".step4.universal.tmp-{host}-{int(dead.stdout)}"
    live = tmp_path / f".step6.universal.tmp-{host}-{os.getpid()}"  # a conversion under way: kept
    elsewhere = tmp_path / f".step8.universal.tmp-another-host-{int(dead.stdout)}"  # its process is not seen here
    for path in (leftover, live, elsewhere):
        (path / "out").mkdir(parents=True)
    universal.remove_stale_temporaries(tmp_path)
    assert not leftover.exists() and live.is_dir() and elsewhere.is_dir()


def test_the_universal_command_line_says_what_is_wrong_in_one_line(tmp_path, capsys):
    ckpts = tmp_path / "run" / "checkpoints"
    checkpoint(ckpts, 2)
    checkpoint(ckpts, 4)
    (ckpts / "step6").mkdir()  # incomplete
    cases = {
        str(tmp_path / "missing"): f"{tmp_path / 'missing'} does not exist",
        str(ckpts): f"{ckpts} is a checkpoints directory, not one checkpoint: it holds step2, step4, step6; convert "
        f"one of them, e.g. python -m ds_exp.universal {ckpts / 'step6'}",
        str(ckpts.parent): f"{ckpts.parent} is a run directory, not one checkpoint",
        str(ckpts / "step6"): "is not a complete checkpoint (it has no ds_exp_complete.json",
    }
    for arg, expected in cases.items():
        assert universal.main([arg]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ds_exp.universal: error: ") and expected in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step2", "step4", "step6"]

    # the process as users run it: argparse's usage and one error line, rc 2, no traceback
    proc = subprocess.run([sys.executable, "-m", "ds_exp.universal"], capture_output=True, text=True, env=user_env())
    assert proc.returncode == 2 and "the following arguments are required: checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
    helped = subprocess.run(
        [sys.executable, "-m", "ds_exp.universal", "--help"], capture_output=True, text=True, env=user_env()
    )
    assert helped.returncode == 0 and "universal format" in helped.stdout and "step<N>" in helped.stdout
