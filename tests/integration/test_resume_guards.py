"""Resumes that cannot surprise: a changed run length or learning rate is named with what it does and takes
effect; a changed global batch or data is refused and changes nothing; one live run per directory; the first
perplexity survives a resume."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ds_exp.model.engine import lr_at
from ds_exp.resume.store import COMPLETE_MARKER, complete_checkpoints
from tests.training import FAST, free_port, launch, logged_steps, train_here, user_env

pytestmark = pytest.mark.slow
SAVED = [*FAST, "train.save_final_checkpoint=true", "train.eval_at_start=true"]


def checksums(root: Path) -> dict[str, str]:
    files = (p for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".ds_exp.lock")
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture
def finished(tmp_path, cache_dir):
    run = train_here(tmp_path / "run", *SAVED, cache_dir=cache_dir)
    assert run.ok, run.explain()
    return run


def console(run) -> str:
    return run.proc.stdout + run.proc.stderr


def test_training_longer_names_the_new_schedule_and_keeps_the_first_perplexity(finished, cache_dir):
    longer = train_here(finished.run_dir, *SAVED, "train.max_steps=12", "resume=auto", cache_dir=cache_dir)
    assert longer.ok, longer.explain()
    said = console(longer)
    assert "the run's length (train.max_steps / train.epochs): 8 steps -> 12 steps" in said
    new = {"total_steps": 12, "warmup_steps": 0, "lr": 1e-3, "scheduler": "cosine", "scheduler_kwargs": {}}
    new["scheduler_owner"] = "ds_exp"
    old = {**new, "total_steps": 8}
    expected = f"the learning rate for step 9 is {lr_at(new, 8):.1e} instead of {lr_at(old, 8):.1e}"
    assert f"the cosine schedule is recomputed over 12 steps instead of 8; {expected}" in said
    lines = {r["step"]: r for r in longer.records("train")}
    for step in (9, 12):  # the schedule in force is the new one (a metric line's lr is the next step's)
        assert lines[step]["lr"] == pytest.approx(lr_at(new, step), abs=1e-12)
    summary = longer.summary
    first = finished.summary["initial_eval"]
    assert summary["initial_eval"] == first and first is not None
    assert f"eval perplexity {first['perplexity']:.3f} ->" in longer.proc.stdout  # not "n/a -> ..."


def test_a_new_learning_rate_takes_effect_and_is_named(finished, cache_dir):
    again = train_here(
        finished.run_dir, *SAVED, "train.max_steps=10", "optimizer.lr=5e-4", "resume=auto", cache_dir=cache_dir
    )
    assert again.ok, again.explain()
    assert "optimizer.lr: 0.001 -> 0.0005" in console(again)
    new = {"total_steps": 10, "warmup_steps": 0, "lr": 5e-4, "scheduler": "cosine", "scheduler_kwargs": {}}
    new["scheduler_owner"] = "ds_exp"
    lines = {r["step"]: r for r in again.records("train")}  # the file holds the first attempt's lines too
    assert lines[9]["lr"] == pytest.approx(lr_at(new, 9), abs=1e-12)


def test_a_changed_global_batch_is_refused_and_changes_nothing(finished, cache_dir):
    before = checksums(finished.run_dir)
    again = train_here(finished.run_dir, *SAVED, "train.max_steps=12", "resume=auto", "train.micro_batch_size=2")
    assert again.proc.returncode == 2, again.explain()
    err = again.proc.stderr
    assert "cannot be continued with these settings" in err and "the global batch is 2 samples, it was 4" in err
    assert "Traceback" not in err
    assert checksums(finished.run_dir) == before  # refused before Hydra wrote anything


def test_changed_data_are_refused_and_the_runs_files_stay(finished, cache_dir):
    before = checksums(finished.run_dir)
    again = train_here(finished.run_dir, *SAVED, "train.max_steps=12", "resume=auto", "data.synthetic.num_train=320")
    assert again.proc.returncode == 2, again.explain()
    assert "the training data differ from the checkpoint's" in again.proc.stderr
    # found once the data are tokenized: the attempt added its config (.hydra/resume-*) and log lines, nothing else
    after = checksums(finished.run_dir)
    kept = {k: v for k, v in after.items() if not k.startswith((".hydra/resume-", "logs/", "ds_exp.log"))}
    assert kept == {k: v for k, v in before.items() if not k.startswith(("logs/", "ds_exp.log"))}


def _start(run_dir: Path, cache_dir: Path, *overrides: str) -> subprocess.Popen:
    args = [*FAST, "train.max_steps=400", "train.log_every=5", *overrides]
    args += [f"hydra.run.dir={run_dir}", f"data.cache_dir={cache_dir}", "data.synthetic.num_train=2048"]
    env = {**user_env(), "MASTER_PORT": str(free_port())}
    return subprocess.Popen(
        [sys.executable, "-m", "ds_exp", *args],
        cwd=run_dir.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _killed_once_ready(run_dir: Path, cache_dir: Path, ready: Callable[[], bool], *, poll_s: float) -> int:
    """Start a run saving every 10 steps, SIGKILL it once `ready()`, and return the step of its newest complete
    checkpoint (the run may have gone on a few steps past `ready` before the kill)."""
    first = _start(run_dir, cache_dir, "train.save_every=10")
    try:
        deadline = time.monotonic() + 180
        while not ready():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(poll_s)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    complete = complete_checkpoints(run_dir / "checkpoints")
    assert complete, "no complete checkpoint before the kill"
    return int(complete[-1].name[len("step") :])


def test_a_second_process_cannot_write_into_a_live_runs_directory(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    first = _start(run_dir, cache_dir)
    try:
        deadline = time.monotonic() + 180
        while logged_steps(run_dir) < 10:
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.1)
        second = launch(run_dir, *FAST, "train.max_steps=400", "resume=auto", cache_dir=cache_dir, timeout=120)
        assert second.proc.returncode == 2, second.explain()
        err = second.proc.stderr
        assert "is in use by a live ds_exp run" in err and f"pid {first.pid}" in err and "Traceback" not in err
        _, stderr = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, stderr[-3000:]
    steps = [
        r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"
    ]
    assert steps == sorted(set(steps))  # no step written twice


def test_a_lock_left_by_a_killed_run_blocks_nobody(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    # the kill lands somewhere after step 15 (steps take milliseconds): resume from the newest complete checkpoint
    newest = _killed_once_ready(run_dir, cache_dir, lambda: logged_steps(run_dir) >= 15, poll_s=0.1)
    assert (run_dir / ".ds_exp.lock").is_file()  # left behind, and harmless
    resumed = launch(
        run_dir,
        *FAST,
        f"train.max_steps={newest + 10}",
        "resume=auto",
        "train.save_every=10",
        "data.synthetic.num_train=2048",
        cache_dir=cache_dir,
    )
    assert resumed.ok, resumed.explain()
    assert resumed.summary["resumed_from"].endswith(f"step{newest}")


def test_a_run_killed_after_its_last_checkpoint_is_finished_by_resume_without_training(tmp_path, cache_dir):
    """A checkpoint at the last step is not a finished run: resume owes it the final evaluation and summary (it
    used to say 'nothing to do' and leave no summary.json), and rewrites nothing of that checkpoint."""
    run_dir = tmp_path / "run"
    step20_done = run_dir / "checkpoints" / "step20" / COMPLETE_MARKER
    last = _killed_once_ready(run_dir, cache_dir, step20_done.is_file, poll_s=0.05)
    before = {p: p.read_bytes() for p in (run_dir / "checkpoints" / f"step{last}").iterdir()}
    lines_before = len((run_dir / "metrics.jsonl").read_text().splitlines())
    again = [*FAST, f"train.max_steps={last}", "resume=auto", "train.save_every=10", "data.synthetic.num_train=2048"]

    finished = launch(run_dir, *again, cache_dir=cache_dir)
    assert finished.ok, finished.explain()
    assert "finishing it without training" in finished.proc.stderr + finished.proc.stdout
    summary = finished.summary
    assert summary["status"] == "completed" and summary["steps"] == last, summary
    assert summary["resumed_from"].endswith(f"step{last}") and summary["final_eval"]["eval_loss"] > 0
    added = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()[lines_before:]]
    assert added and all(r["type"] != "train" for r in added), added  # an evaluation, and no step trained
    assert {p: p.read_bytes() for p in before} == before

    repeated = launch(run_dir, *again, cache_dir=cache_dir)  # now it is finished: nothing to do
    assert repeated.ok and "nothing to do" in repeated.proc.stdout, repeated.explain()
    assert repeated.summary == summary


def _module_weights(tag_dir: Path) -> dict:
    import torch

    return torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["module"]


def _same_weights(a: dict, b: dict) -> bool:
    import torch

    return all(torch.equal(a[name].float(), b[name].float()) for name in b if name in a)


def test_a_resume_from_an_older_checkpoint_sets_the_later_ones_aside_and_continues_only_its_own(tmp_path, cache_dir):
    """Issue 21 §1: resuming from step 6 of a run that went on to step 8, with another learning rate, keep_last 1
    and a save every step: the first trajectory's step 8 is moved into checkpoints/branches/ (named in one warning),
    never deleted, never kept as the newest, never taken for the new step 8; a kill before the new branch's first save
    leaves `latest` and resume=auto on step 6; the final checkpoint, the export and the summary hold the same
    weights. A resume in another run directory from this one's checkpoint sets that directory's own checkpoints
    aside and changes nothing here."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    first = train_here(
        run_dir, *FAST, "train.save_every=2", "train.keep_last=2", "train.export_every=7", cache_dir=cache_dir
    )
    assert first.ok, first.explain()
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step6", "step8"]
    first_export7 = checksums(run_dir / "hf_model-step7")  # made on the branch a resume from step 6 abandons
    first_step8 = checksums(ckpts / "step8")
    copy = tmp_path / "copy"  # a user's copy of the run directory, to branch off from (cp -a)
    shutil.copytree(run_dir, copy, symlinks=True)

    again = [*FAST, "optimizer.lr=5e-3", "train.save_every=1", "train.keep_last=1"]
    again += ["train.save_final_checkpoint=true", "train.export=true"]
    fault = {"DS_EXP_FAULT": "save:step7"}  # killed at the new branch's first save
    killed = launch(run_dir, *again, f"resume={ckpts / 'step6'}", cache_dir=cache_dir, env=fault)
    assert killed.proc.returncode == -signal.SIGKILL, killed.explain()
    (branch,) = (ckpts / "branches").iterdir()
    assert checksums(branch / "step8") == first_step8  # moved whole, not deleted
    said = console(killed)
    assert (
        f"step8, hf_model-step7 moved (nothing deleted) into {branch}; to go back to it: resume={branch / 'step8'}"
        in said
    )
    assert checksums(branch / "exports" / "hf_model-step7") == first_export7  # set aside with its branch
    assert (ckpts / "latest").read_text() == "step6"  # never the moved step8, never the incomplete step7
    assert complete_checkpoints(ckpts)[-1] == ckpts / "step6"  # what resume=auto continues

    done = launch(run_dir, *again, "resume=auto", cache_dir=cache_dir)
    assert done.ok, done.explain()
    summary = done.summary
    assert summary["resumed_from"] == str(ckpts / "step6") and summary["steps"] == 8, summary
    assert summary["checkpoint"] == str(ckpts / "step8") and "not saved again" not in console(done)
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step8"] and (ckpts / "latest").read_text() == "step8"
    exported = {}
    for file in (run_dir / "hf_model").glob("*.safetensors"):
        exported.update(load_file(file))
    final = _module_weights(ckpts / "step8")
    assert exported and _same_weights(final, exported)  # the final checkpoint holds the exported weights
    assert not _same_weights(_module_weights(branch / "step8"), exported)  # (the first trajectory's did not)
    assert checksums(branch / "step8") == first_step8

    before = checksums(run_dir)
    elsewhere = train_here(copy, *again, "train.max_steps=10", f"resume={ckpts / 'step8'}", cache_dir=cache_dir)
    assert elsewhere.ok, elsewhere.explain()
    assert checksums(run_dir) == before  # nothing rotated, moved or rewritten in the other directory
    (set_aside,) = (copy / "checkpoints" / "branches").iterdir()
    assert sorted(p.name for p in set_aside.glob("step*")) == ["step6", "step8"]  # the copy's own, kept
    assert sorted(p.name for p in (copy / "checkpoints").glob("step*")) == ["step10"]
