"""Resume anywhere (issue 16 §2): a checkpoint continues after the world size, the ZeRO stage or the offload
changed, through DeepSpeed's universal format (converted once, cached beside the checkpoint, the original
untouched), and at an equal global batch the losses continue as the uninterrupted run's (fp32, <= 1e-3 relative).

Each reference run is uninterrupted and saves at step 4 on the way; the resumed runs start from that checkpoint
in directories of their own and train steps 5-8."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ds_exp.checkpoint.universal import (
    MARKER,
    MODEL_STATES,
    PARAM_NAMES_KEY,
    conversion_status,
    convert_here,
    is_converted,
    main,
    universal_dir,
)
from ds_exp.core.errors import ResumeError
from ds_exp.resume.store import read_marker
from tests.training import FAST, Run, assert_close, free_port, launch, train_here, user_env

pytestmark = pytest.mark.slow
SAVING = [*FAST, "train.save_every=4"]  # global batch 4 x ranks x accumulation; checkpoints at steps 4 and 8
REL = 1e-3  # the bound; with torch's AdamW on both sides the arithmetic allows (and gets) far less
EXACT = 1e-5  # observed ~1e-7; without compat.fix_zero3_universal_load the ZeRO-3 resume drifts to ~7e-4


def checksums(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def resumed(reference: Run, run_dir: Path, *overrides: str, cache_dir: Path, nproc: int = 1) -> Run:
    args = [*SAVING, f"resume={reference.run_dir / 'checkpoints' / 'step4'}", *overrides]
    if nproc > 1:
        run = launch(run_dir, *args, launcher="ranks", nproc=nproc, cache_dir=cache_dir)
    else:
        run = train_here(run_dir, *args, cache_dir=cache_dir)
    assert run.ok, run.explain()
    return run


def zero2_reference(root: Path, cache_dir: Path, *overrides: str) -> Run:
    """Uninterrupted: 2 ranks, ZeRO-2, micro batch 4: global batch 8."""
    run = launch(root, *SAVING, "zero=stage2", *overrides, launcher="ranks", nproc=2, cache_dir=cache_dir)
    assert run.ok, run.explain()
    return run


@pytest.fixture(scope="module")
def zero2_two_ranks(tmp_path_factory, cache_dir) -> Run:
    return zero2_reference(tmp_path_factory.mktemp("ref") / "zero2_2ranks", cache_dir)


@pytest.fixture(scope="module")
def lora_zero2_two_ranks(tmp_path_factory, cache_dir) -> Run:
    """With LoRA: only the adapters are in the optimizer, so in the ZeRO files ds_to_universal converts."""
    return zero2_reference(tmp_path_factory.mktemp("ref") / "lora_zero2_2ranks", cache_dir, "lora.dim=8")


def to_zero3_one_rank(reference: Run, root: Path, cache_dir: Path, *overrides: str) -> tuple[Run, dict[str, str]]:
    """2 ranks ZeRO-2 -> 1 rank ZeRO-3 with 2 accumulation steps (global batch 8), and the checkpoint's files
    before the resume converted it."""
    before = checksums(reference.run_dir / "checkpoints" / "step4")
    run = resumed(
        reference, root, "zero=stage3", "train.gradient_accumulation_steps=2", *overrides, cache_dir=cache_dir
    )
    return run, before


@pytest.fixture(scope="module")
def zero3_one_rank(zero2_two_ranks, tmp_path_factory, cache_dir) -> tuple[Run, dict[str, str]]:
    return to_zero3_one_rank(zero2_two_ranks, tmp_path_factory.mktemp("resumed") / "zero3_1rank", cache_dir)


@pytest.fixture(scope="module")
def lora_one_rank(tmp_path_factory, cache_dir) -> Run:
    """Uninterrupted: 1 rank, ZeRO stage 0 (the default), LoRA, 2 accumulation steps: global batch 8."""
    run = train_here(
        tmp_path_factory.mktemp("ref") / "lora_1rank",
        *SAVING,
        "lora.dim=8",
        "train.gradient_accumulation_steps=2",
        cache_dir=cache_dir,
    )
    assert run.ok, run.explain()
    return run


def continued(reference: Run, run: Run, rel: float = EXACT) -> None:
    """The resumed run trained steps 5-8, with the uninterrupted run's losses and learning rates."""
    ref = {r["step"]: r for r in reference.records("train")}
    got = run.records("train")
    assert [r["step"] for r in got] == [5, 6, 7, 8]
    assert_close([r["loss"] for r in got], [ref[r["step"]]["loss"] for r in got], rel=rel)
    assert [r["lr"] for r in got] == pytest.approx([ref[r["step"]]["lr"] for r in got], rel=1e-9, abs=1e-12)


def test_two_ranks_zero2_continue_on_one_rank_zero3(zero2_two_ranks, zero3_one_rank):
    run, before = zero3_one_rank
    continued(zero2_two_ranks, run)
    said = run.proc.stdout + run.proc.stderr
    assert "resume: world_size: 2 in the checkpoint, 1 now" in said
    assert "resume: zero_stage: 2 in the checkpoint, 3 now" in said
    assert "converting" in said and "to DeepSpeed's universal format (once)" in said
    tag_dir = zero2_two_ranks.run_dir / "checkpoints" / "step4"
    assert (universal_dir(tag_dir) / MARKER).is_file()  # cached beside the checkpoint
    assert checksums(tag_dir) == before  # the original is only read
    summary = run.summary
    assert summary["status"] == "completed" and summary["resumed_from"] == str(tag_dir)
    assert summary["world_size"] == 1 and summary["zero_stage"] == 3


def holds_only_what_trains(run: Run, tag: str = "step4") -> None:
    """A LoRA checkpoint holds the adapters and their optimizer states, not the frozen base (issue 35 §4): the
    module's weights in it are exactly the run's trainable ones, and its marker records the base it leaves out."""
    tag_dir = run.run_dir / "checkpoints" / tag
    module = torch.load(tag_dir / MODEL_STATES[0], map_location="cpu", weights_only=False)["module"]
    summary = run.summary
    assert module and all("lora_" in name for name in module), sorted(module)[:4]
    assert sum(t.numel() for t in module.values()) == summary["trainable_parameters"]
    base = read_marker(tag_dir)["base"]
    assert base["elements"] + summary["trainable_parameters"] == summary["parameters"] and len(base["sha256"]) == 64


def test_two_ranks_zero2_with_lora_continue_on_one_rank_zero3(lora_zero2_two_ranks, tmp_path, cache_dir):
    """Only the adapters are in the checkpoint: ds_to_universal converts them and their Adam states, nothing else;
    the ZeRO-3 engine restores the adapters and keeps the base as built (the one the checkpoint records)."""
    holds_only_what_trains(lora_zero2_two_ranks)
    run, before = to_zero3_one_rank(lora_zero2_two_ranks, tmp_path / "lora_zero3", cache_dir, "lora.dim=8")
    continued(lora_zero2_two_ranks, run)
    tag_dir = lora_zero2_two_ranks.run_dir / "checkpoints" / "step4"
    assert checksums(tag_dir) == before
    zero = universal_dir(tag_dir) / "zero"
    converted = {p.name for p in zero.iterdir() if p.is_dir()}
    assert converted and all((zero / name / "exp_avg.pt").is_file() for name in converted), converted
    assert all("lora_" in name for name in converted), converted  # no frozen weight: the checkpoint has none


def test_an_offload_change_reuses_the_cached_conversion(zero2_two_ranks, zero3_one_rank, tmp_path, cache_dir):
    tag_dir = zero2_two_ranks.run_dir / "checkpoints" / "step4"
    cached = universal_dir(tag_dir) / MARKER
    written = cached.stat().st_mtime_ns
    run = resumed(zero2_two_ranks, tmp_path / "offload", "zero=stage2", "offload=cpu", nproc=2, cache_dir=cache_dir)
    continued(zero2_two_ranks, run, rel=REL)  # DeepSpeed's CPU Adam instead of torch's AdamW: other rounding
    said = run.proc.stdout + run.proc.stderr
    assert "resume: offload: " in said and '"optimizer": "cpu"' in said
    assert "reusing the conversion" in said and "(once) ..." not in said
    assert cached.stat().st_mtime_ns == written


def test_one_rank_with_lora_continues_on_two_ranks_zero2(lora_one_rank, tmp_path, cache_dir):
    """Stage 0 -> ZeRO-2: ds_exp converts the stage-0 optimizer state (only the adapters are in it, as in the
    checkpoint; the frozen base weights are the ones built)."""
    holds_only_what_trains(lora_one_rank)
    run = resumed(lora_one_rank, tmp_path / "lora_2ranks", "lora.dim=8", "zero=stage2", nproc=2, cache_dir=cache_dir)
    continued(lora_one_rank, run)
    zero = universal_dir(lora_one_rank.run_dir / "checkpoints" / "step4") / "zero"
    converted = {p.name for p in zero.iterdir() if p.is_dir()}
    assert converted and all("lora_" in name for name in converted), converted  # the trainable ones only


def test_stage0_world_size_change_needs_no_conversion(lora_one_rank, tmp_path, cache_dir):
    """At stage 0 rank 0 saved the whole optimizer state: any world size loads it as it is."""
    run = resumed(lora_one_rank, tmp_path / "lora_stage0_2ranks", "lora.dim=8", nproc=2, cache_dir=cache_dir)
    continued(lora_one_rank, run)
    said = run.proc.stdout + run.proc.stderr
    assert "resume: world_size: 1 in the checkpoint, 2 now" in said
    assert "universal format (once)" not in said and "reusing the conversion" not in said


def test_a_failed_conversion_leaves_nothing_that_is_trusted(zero2_two_ranks, tmp_path):
    tag_dir = tmp_path / "checkpoints" / "step4"
    shutil.copytree(zero2_two_ranks.run_dir / "checkpoints" / "step4", tag_dir)
    damaged = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    damaged.write_bytes(damaged.read_bytes()[:1000])  # truncated, as by a full disk
    before = checksums(tag_dir)
    with pytest.raises(ResumeError, match=r"converting .* to DeepSpeed's universal format failed"):
        convert_here(tag_dir)
    assert sorted(p.name for p in tag_dir.parent.iterdir()) == ["step4"]  # no copy, no temporary directory
    assert checksums(tag_dir) == before


@pytest.fixture(scope="module")
def bf16_zero3_one_rank(tmp_path_factory, cache_dir) -> Run:
    """Uninterrupted: 1 rank, bf16, ZeRO-3 (global batch 4)."""
    run = train_here(
        tmp_path_factory.mktemp("ref") / "bf16_zero3", *SAVING, "precision=bf16", "zero=stage3", cache_dir=cache_dir
    )
    assert run.ok, run.explain()
    return run


def test_bf16_zero3_continues_at_zero1(bf16_zero3_one_rank, tmp_path, cache_dir):
    """ZeRO-3 -> ZeRO-1 in bf16: DeepSpeed's stage-3 files converted, loaded by a stage-1 engine with bf16 weights."""
    run = resumed(bf16_zero3_one_rank, tmp_path / "zero1", "precision=bf16", "zero=stage1", cache_dir=cache_dir)
    continued(bf16_zero3_one_rank, run)
    said = run.proc.stdout + run.proc.stderr
    assert "resume: zero_stage: 3 in the checkpoint, 1 now" in said and "universal format (once)" in said
    assert run.summary["precision"] == "bf16" and run.summary["zero_stage"] == 1


def processes_running(*fragments: str) -> list[int]:
    """Live processes whose command line holds every fragment."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration, UnicodeDecodeError):
            continue
        if all(f in cmdline for f in fragments) and "zombie" not in state:
            found.append(int(entry.name))
    return found


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.05)


def copied_checkpoint(reference: Run, root: Path, tag: str = "step4") -> Path:
    """A copy of a reference's checkpoint (mtimes kept, as cp -a), in a checkpoints directory of its own."""
    tag_dir = root / "checkpoints" / tag
    shutil.copytree(reference.run_dir / "checkpoints" / tag, tag_dir)
    return tag_dir


def temporaries(tag_dir: Path) -> list[str]:
    return [p.name for p in tag_dir.parent.glob(f".{tag_dir.name}.universal.tmp-*")]


def test_a_conversion_whose_parent_is_killed_leaves_no_process_and_no_temporary(zero2_two_ranks, tmp_path):
    tag_dir = copied_checkpoint(zero2_two_ranks, tmp_path)
    code = "from pathlib import Path; from ds_exp.checkpoint.universal import convert_here; "
    code += f"convert_here(Path({str(tag_dir)!r}))"
    parent = subprocess.Popen([sys.executable, "-c", code], env=user_env())
    try:
        wait_until(
            lambda: processes_running("ds_exp.checkpoint.conversion", str(tag_dir)), 120, "the conversion started"
        )
        assert temporaries(tag_dir)
    finally:
        parent.kill()
        parent.wait()
    # its SIGTERM handler runs between bytecodes of a process that may sit in a long C call: on 2 busy cores (a
    # parallel benchmark, load 4) 20 s was not always enough; without the parent-death signal it never dies at all
    wait_until(lambda: not processes_running("ds_exp.checkpoint.conversion", str(tag_dir)), 90, "the converter died")
    wait_until(lambda: not temporaries(tag_dir), 30, "its temporary directory is gone")
    assert sorted(p.name for p in tag_dir.parent.iterdir()) == ["step4"]


def test_a_stop_during_a_resumes_conversion_names_the_checkpoint_to_continue_from(zero2_two_ranks, tmp_path, cache_dir):
    """The run directory holds no checkpoint: `resume=auto` would start over from step 0."""
    tag_dir = copied_checkpoint(zero2_two_ranks, tmp_path / "source")
    run_dir = tmp_path / "resumed"
    args = [*SAVING, f"resume={tag_dir}", "zero=stage3", "train.gradient_accumulation_steps=2"]
    args += [f"hydra.run.dir={run_dir}", f"data.cache_dir={cache_dir}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ds_exp", *args],
        cwd=tmp_path,
        env={**user_env(), "MASTER_PORT": str(free_port())},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: processes_running("ds_exp.checkpoint.conversion", str(tag_dir)), 180, "the conversion started"
        )
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert f"hydra.run.dir={run_dir} resume={tag_dir}" in err and "resume=auto" not in err, err[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped"
    assert not processes_running("ds_exp.checkpoint.conversion", str(tag_dir))
    assert sorted(p.name for p in tag_dir.parent.iterdir()) == ["step4"]  # no conversion, no temporary


def test_a_stale_conversion_is_made_again(zero2_two_ranks, zero3_one_rank, tmp_path, caplog):
    """A conversion is reused only for the exact checkpoint it came from: the same files (a copy that keeps mtimes)
    reuse it; a checkpoint rewritten since gets a new one, with one line saying why."""
    source = zero2_two_ranks.run_dir / "checkpoints"
    tag_dir = copied_checkpoint(zero2_two_ranks, tmp_path)
    shutil.copytree(universal_dir(source / "step4"), universal_dir(tag_dir))
    assert is_converted(tag_dir)  # the cached conversion of these files: reused
    for file in (source / "step8").iterdir():  # another state of the run at the same path
        shutil.copy(file, tag_dir / file.name)
    assert not is_converted(tag_dir)  # (it was: the conversion's marker alone made it count)
    usable, why = conversion_status(tag_dir)
    assert not usable and "changed since it was converted (ds_exp_complete.json, mp_rank_00_model_states.pt" in why
    old = torch_file(universal_dir(tag_dir))
    assert main([str(tag_dir)]) == 0
    assert is_converted(tag_dir) and torch_file(universal_dir(tag_dir)) != old
    assert sorted(p.name for p in tag_dir.parent.iterdir()) == ["step4", "step4.universal"]


def torch_file(udir: Path) -> bytes:
    """The bytes of one converted optimizer state (the first trainable parameter's fp32 master weights)."""
    first = sorted(p for p in (udir / "zero").iterdir() if (p / "exp_avg.pt").is_file())[0]
    return (first / "fp32.pt").read_bytes()


def test_the_command_line_converts_a_zero0_checkpoint_or_says_why_not(lora_one_rank, tmp_path, capsys):
    import torch

    tag_dir = copied_checkpoint(lora_one_rank, tmp_path / "new")
    assert main([str(tag_dir)]) == 0
    converted = {p.name for p in (universal_dir(tag_dir) / "zero").iterdir() if p.is_dir()}
    assert converted and all("lora_" in name for name in converted), converted
    capsys.readouterr()

    older = copied_checkpoint(lora_one_rank, tmp_path / "older")  # as ds_exp wrote them before it recorded the names
    states = older / MODEL_STATES[0]
    saved = torch.load(states, weights_only=False)
    del saved[PARAM_NAMES_KEY]
    torch.save(saved, states)
    assert main([str(older)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "is a ZeRO-0 checkpoint written before ds_exp recorded its parameter names" in err[-1], err
    assert err[-1].startswith("ds_exp.universal: error: ") and "Traceback" not in "\n".join(err)
    assert sorted(p.name for p in older.parent.iterdir()) == ["step4"]


def test_the_command_line_says_when_the_disk_is_too_small(zero2_two_ranks, mount_tmpfs, capsys):
    size = sum(p.stat().st_size for p in (zero2_two_ranks.run_dir / "checkpoints" / "step4").iterdir())
    disk = mount_tmpfs(f"{size + 2 * 2**20}")  # the checkpoint and 2 MiB: too small for its conversion
    tag_dir = copied_checkpoint(zero2_two_ranks, disk)
    assert main([str(tag_dir)]) == 2
    err = capsys.readouterr().err
    assert f"no room to convert {tag_dir} beside it: the conversion needs about " in err and " free; " in err, err
    assert sorted(p.name for p in tag_dir.parent.iterdir()) == ["step4"]
