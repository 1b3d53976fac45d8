"""`python -m ds_exp.parity A -- B` as users run it: real ds_exp runs on each side (tiny model, fp32, a few steps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training import user_env

pytestmark = pytest.mark.slow

STEPS = 3
SMALL = ["train.micro_batch_size=4", "data.synthetic.num_train=256", "data.synthetic.num_eval=32"]


def parity(cwd: Path, cache_dir: Path, *args: str, a: list[str], b: list[str]) -> subprocess.CompletedProcess:
    common = [*SMALL, f"data.cache_dir={cache_dir}"]
    cmd = [sys.executable, "-m", "ds_exp.parity", "--steps", str(STEPS), "--out", "cmp", *args, *common, *a, "--"]
    return subprocess.run([*cmd, *common, *b], cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=900)


def result(cwd: Path) -> dict:
    return json.loads((cwd / "cmp" / "parity.json").read_text())


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


def test_zero2_and_zero3_agree(tmp_path, cache_dir):
    proc = parity(tmp_path, cache_dir, a=["zero=stage2"], b=["zero=stage3"])
    assert proc.returncode == 0, explain(proc)
    assert "PASS: 3 steps within tolerance" in proc.stdout
    rows = result(tmp_path)["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["grad_norm_a"] and r["grad_norm_b"] for r in rows)  # grad_norm is compared, not skipped
    assert rows[-1]["loss_a"] < rows[0]["loss_a"]  # it trains
    assert json.loads((tmp_path / "cmp" / "B" / "summary.json").read_text())["zero_stage"] == 3


def test_two_ranks_agree_with_one_rank_accumulating(tmp_path, cache_dir):
    """ZeRO stage 0 in fp32 (the default): grad_norm comes from ds_exp.core.compat.keep_fp32_grad_norm."""
    proc = parity(
        tmp_path,
        cache_dir,
        "--ranks",
        "2,1",
        a=["train.micro_batch_size=2"],
        b=["train.micro_batch_size=2", "train.gradient_accumulation_steps=2"],
    )
    assert proc.returncode == 0, explain(proc)
    assert "PASS" in proc.stdout
    assert all(r["grad_norm_a"] and r["grad_norm_b"] for r in result(tmp_path)["rows"])
    summaries = [json.loads((tmp_path / "cmp" / s / "summary.json").read_text()) for s in "AB"]
    assert [s["world_size"] for s in summaries] == [2, 1]


def test_a_different_learning_rate_fails_with_the_table(tmp_path, cache_dir):
    proc = parity(tmp_path, cache_dir, a=["optimizer.lr=1e-3"], b=["optimizer.lr=3e-3"])
    assert proc.returncode == 1, explain(proc)
    lines = proc.stdout.splitlines()
    assert any(line.split()[:1] == ["step"] and "grad_norm A" in line for line in lines), proc.stdout
    # the same initial weights: step 1 (before any update) agrees, the steps after it do not
    rows = result(tmp_path)["rows"]
    assert rows[0]["ok"] and rows[0]["loss_diff"] < 1e-6
    assert not rows[1]["ok"] and not rows[2]["ok"]
    assert "FAIL: 2 of 3 steps out of tolerance; first at step 2: " in proc.stdout
    table = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"], ["3"])]
    assert [row[-1] for row in table] == ["ok", "DIFFERS", "DIFFERS"], proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_packing_on_and_off_agree_where_it_joins_nothing(tmp_path, cache_dir):
    """The synthetic examples are 15 to 32 tokens: at max_seq_len 29 no two fit one row, at 64 they do."""
    proc = parity(tmp_path, cache_dir, a=["data.max_seq_len=29"], b=["data.max_seq_len=29", "data.packing=true"])
    assert proc.returncode == 0, explain(proc)
    assert "PASS" in proc.stdout

    (tmp_path / "x").mkdir()
    refused = parity(tmp_path / "x", cache_dir, a=[], b=["data.packing=true"])
    assert refused.returncode == 2, explain(refused)
    assert "data.packing differs (side B packs)" in refused.stderr
    assert "data.max_seq_len=29 or less on both sides" in refused.stderr
    assert not (tmp_path / "x" / "cmp").exists()


def test_comparisons_that_cannot_agree_are_refused_before_anything_runs(tmp_path, cache_dir):
    proc = parity(
        tmp_path,
        cache_dir,
        a=["model.arch.num_hidden_layers=1", "scheduler=linear"],
        b=["train.micro_batch_size=2", "train.seed=7", "lora.dim=8"],
    )
    assert proc.returncode == 2, explain(proc)
    err = proc.stderr
    assert err.startswith("ds_exp: error: parity refuses to compare these sides"), err
    assert "the global batch differs: A = micro 4 x accumulation 1 x 1 rank = 4, B = micro 2" in err
    assert "add train.gradient_accumulation_steps=2 to side B" in err
    assert "model.arch.num_hidden_layers differs (A 1, B 2)" in err
    assert "train.seed differs (A 1234, B 7)" in err
    assert "scheduler.name differs (A linear, B cosine)" in err
    assert "lora.dim differs (A 0, B 8)" in err
    assert "Traceback" not in err
    assert not (tmp_path / "cmp").exists()

    flag = parity(tmp_path, cache_dir, a=["train.max_steps=9"], b=["-m"])
    assert flag.returncode == 2, explain(flag)
    assert "side A: train.max_steps=9: parity sets it from --steps N" in flag.stderr
    assert "side B: -m: not a Hydra override" in flag.stderr


def test_a_side_without_grad_norm_is_compared_on_losses_and_a_missing_step_fails(tmp_path):
    from ds_exp.tools.parity.compare import Tolerance, compare, notes, verdict
    from ds_exp.tools.parity.runs import SideRun

    def side(*lines: tuple[float, float | None]) -> SideRun:
        records = [{"type": "train", "step": i, "loss": loss, "grad_norm": g} for i, (loss, g) in enumerate(lines, 1)]
        return SideRun(tmp_path, tmp_path / "log", 0, 1.0, records=records)

    tol = Tolerance(loss=1e-3, grad_norm=1e-2)
    a, b = side((6.0, None), (5.0, None)), side((6.0, 7.0), (5.0, 9.0))
    rows = compare(a, b, 2, tol)
    assert all(r.ok for r in rows) and verdict(rows, tol).startswith("PASS")
    assert notes(rows) and "side A logged no grad_norm" in notes(rows)[0]
    rows = compare(a, side((6.0, 7.0)), 2, tol)
    assert [r.ok for r in rows] == [True, False]
    assert verdict(rows, tol).endswith("first at step 2: side B logged no loss for it")


def test_values_that_are_not_finite_fail_even_on_both_sides(tmp_path, cache_dir):
    """Issue 21's case: `nan` against 6.238325 once passed as `0.0e+00 ok`. Side A (ZeRO-0, fp32) turns NaN, side
    B (ZeRO-1) skips every update after the first for its non-finite gradients: both end diverged, and each of
    those steps fails the comparison."""
    proc = parity(tmp_path, cache_dir, a=["zero=stage0", "optimizer.lr=1e30"], b=["zero=stage1", "optimizer.lr=1e30"])
    assert proc.returncode == 1, explain(proc)
    assert "Traceback" not in proc.stdout + proc.stderr
    record = result(tmp_path)
    assert [r["ok"] for r in record["rows"]] == [True, False, False], proc.stdout
    assert record["rows"][2]["loss_a"] is None and "rows.2.loss_a" in record["non_finite"]  # strict JSON
    assert record["rows"][2]["loss_b"] is not None and not record["passed"] and record["diverged"] == ["A", "B"]
    assert "first at step 2: the grad_norm is not finite (NaN or inf) on both sides: both diverged" in proc.stdout
    assert [line.split()[-2:] for line in proc.stdout.splitlines() if line.split()[:1] == ["3"]] == [["NOT", "FINITE"]]
    assert "side A diverged after" in proc.stderr and "side B diverged after" in proc.stderr
    for name in "AB":
        assert json.loads((tmp_path / "cmp" / name / "summary.json").read_text())["status"] == "diverged"
