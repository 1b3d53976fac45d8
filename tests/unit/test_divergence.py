"""A diverged run is a failed run (ds_exp/divergence.py), and every JSON file ds_exp writes is strict JSON
(ds_exp/core/files.py): the pieces in this process. A real diverged run: tests/integration/test_faults.py and
tests/integration/test_parity.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ds_exp.core.errors import Diverged
from ds_exp.core.files import json_text, restore_non_finite, write_json_atomic

NAN, INF = float("nan"), float("inf")


def strict(text: str):
    """json.loads that refuses NaN / Infinity as other JSON parsers do."""

    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_null_and_named():
    payload = {
        "loss": NAN,
        "final_eval": {"eval_loss": INF, "perplexity": 2.5},
        "rows": [{"x": -INF}, {"x": 1.0}],
        "tensor": torch.tensor(NAN),
        "numpy": np.float32(1.5),
        "path": Path("/a/b"),
        "n": 3,
    }
    record = strict(json_text(payload))
    assert record["loss"] is None and record["final_eval"] == {"eval_loss": None, "perplexity": 2.5}
    assert record["rows"] == [{"x": None}, {"x": 1.0}] and record["tensor"] is None and record["numpy"] == 1.5
    assert record["path"] == "/a/b" and record["n"] == 3
    assert record["non_finite"] == ["loss", "final_eval.eval_loss", "rows.0.x", "tensor"]
    back = restore_non_finite(record)
    assert math.isnan(back["loss"]) and math.isnan(back["final_eval"]["eval_loss"]) and "non_finite" not in back
    assert strict(json_text({"loss": 1.0})) == {"loss": 1.0}  # nothing to name: no list


def test_every_writer_of_run_files_writes_strict_json(tmp_path):
    from ds_exp.artifacts.summary import RunState, write_summary
    from ds_exp.artifacts.tracking import MetricsLog
    from ds_exp.train.generate import write_generations

    metrics = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    metrics.write({"type": "train", "step": 3, "loss": NAN, "grad_norm": INF, "lr": 1e-3})
    metrics.close()
    (line,) = map(strict, (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert line["loss"] is None and line["non_finite"] == ["loss", "grad_norm"] and line["lr"] == 1e-3

    state = RunState(tmp_path, "single", world_size=1)
    state.status, state.train_loss, state.final_eval = "diverged", NAN, {"eval_loss": NAN, "perplexity": NAN}
    write_summary(state, peaks=[1])
    summary = strict((tmp_path / "summary.json").read_text())
    assert summary["train_loss"] is None and summary["status"] == "diverged"
    assert summary["non_finite"] == ["train_loss", "final_eval.eval_loss", "final_eval.perplexity"]

    write_json_atomic(tmp_path / "plan.json", {"estimate": INF})
    assert strict((tmp_path / "plan.json").read_text()) == {"estimate": None, "non_finite": ["estimate"]}
    write_generations(tmp_path / "generations.jsonl", 1, ["héllo"], ["wörld"])
    assert strict((tmp_path / "generations.jsonl").read_text())["completion"] == "wörld"


def test_no_module_writes_json_past_the_strict_writer():
    """json.dumps / json.dump appear only in ds_exp/core/files.py, or where their text is no file (a message, a hash
    key, an in-memory copy): a new writer cannot bring bare NaN back."""
    import ast

    package = Path(__file__).resolve().parents[2] / "ds_exp"
    # messages, keys, copies
    not_files = {
        "config/ds_config.py",
        "config/validate.py",
        "config/optimizer_checks.py",
        "tools/autotune.py",
        "data/cache.py",
        "resume/settings.py",
        "checkpoint/universal.py",
        "evaluation/fit.py",  # a row's length, measured
    }
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            called = isinstance(node, ast.Attribute) and node.attr in ("dump", "dumps")
            if called and isinstance(node.value, ast.Name) and node.value.id == "json":
                found.add(str(path.relative_to(package)))
    assert found - not_files == {"core/files.py"}, found


# ---------------------------------------------------------------------------------------- the end state


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def engine_with(weight: torch.Tensor, zero3: bool = False) -> SimpleNamespace:
    module = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        if zero3:  # a ZeRO-3 parameter: an empty placeholder, the rank's partition in ds_tensor
            module.weight.data = torch.empty(0)
            module.weight.ds_tensor = weight
        else:
            module.weight.copy_(weight)
    return SimpleNamespace(module=module, device=torch.device("cpu"))


def test_the_end_state_names_what_is_not_finite(one_rank):
    from ds_exp.model.divergence import non_finite_end

    good, bad = torch.ones(2, 2), torch.tensor([[1.0, NAN], [0.0, 1.0]])
    assert non_finite_end(engine_with(good), torch.tensor(3.0), {"eval_loss": 1.0, "eval_tokens": 9.0}) == []
    assert non_finite_end(engine_with(good), None, None) == []  # a resume that trained no step, no eval set
    assert non_finite_end(engine_with(good), torch.tensor(INF), {"eval_loss": 1.0}) == ["the last step's loss"]
    assert non_finite_end(engine_with(good), torch.tensor(1.0), {"eval_loss": NAN}) == ["the final evaluation"]
    overflowed = non_finite_end(engine_with(good), torch.tensor(1.0), None, last_step_overflowed=True)
    assert overflowed == ["the last step's gradients (its update was skipped)"]
    assert non_finite_end(engine_with(bad), torch.tensor(1.0), None) == ["the weights"]
    assert non_finite_end(engine_with(bad, zero3=True), torch.tensor(1.0), None) == ["the weights"]


def test_weights_that_are_not_finite_are_never_saved(one_rank):
    from ds_exp.model.divergence import check_weights_finite

    check_weights_finite(engine_with(torch.ones(2, 2)), 4, "did not save checkpoint step4", None)
    with pytest.raises(Diverged) as err:
        check_weights_finite(engine_with(torch.full((2, 2), INF), zero3=True), 4, "did not save it", "/r/step2")
    assert "NaN or inf in the weights at step 4: the run diverged and did not save it" in str(err.value)
    assert "the newest checkpoint with finite weights is /r/step2" in str(err.value)
    assert err.value.exit_code == 3 and err.value.status == "diverged"


def test_an_export_of_weights_that_are_not_finite_writes_nothing(one_rank, tmp_path):
    from ds_exp.exports.writer import export_hf

    engine = engine_with(torch.tensor([[1.0, NAN], [0.0, 1.0]]))
    with pytest.raises(Diverged, match=r"the weights are not finite \(NaN or inf\) in weight: .*nothing was exported"):
        export_hf(engine, zero_stage=0, spec=None, tokenizer=None, export_dir=tmp_path / "hf", save_adapter=False)
    assert list(tmp_path.iterdir()) == [tmp_path / "store"]


def test_weights_a_dtype_cannot_hold_are_refused_or_written_in_one_that_can():
    """The finiteness check runs on what is written: 7e4 is finite in fp32 and inf in fp16 (largest 65504)."""
    from ds_exp.core.errors import RunFailed
    from ds_exp.exports.writer import fitting_dtype

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = 7.0e4
    asked = SimpleNamespace(dtype="fp16", dtype_key="--dtype")
    with pytest.raises(RunFailed) as err:
        fitting_dtype(model, asked, "float16", "--dtype=fp16")  # type: ignore[arg-type]
    assert "--dtype=fp16 cannot hold the weights: weight reaches 70000, beyond float16's largest (65504)" in str(err)
    auto = SimpleNamespace(dtype="auto", dtype_key="train.export_dtype")
    chosen = fitting_dtype(model, auto, "float16", "the base checkpoint's dtype")  # type: ignore[arg-type]
    assert chosen == (
        "float32",
        "the base checkpoint's dtype; but weight reaches 70000, beyond float16's largest (65504): float32",
    )
    assert fitting_dtype(model, asked, "bfloat16", "why") == ("bfloat16", "why")  # bf16 has fp32's range


# -------------------------------------------------------------------------------- readers of the verdict


def side(tmp_path: Path, losses: list, status: str = "completed"):
    from ds_exp.tools.parity.runs import SideRun

    records = [json.loads(json_text({"type": "train", "step": i + 1, "loss": v})) for i, v in enumerate(losses)]
    return SideRun(tmp_path, tmp_path / "log", 0, 1.0, summary={"status": status}, records=records)


def test_parity_fails_on_a_value_that_is_not_finite_on_either_side(tmp_path):
    from ds_exp.tools.parity.compare import Tolerance, compare, table, verdict

    tol = Tolerance(loss=1e-3, grad_norm=1e-2)
    rows = compare(side(tmp_path, [6.2, 6.1, NAN]), side(tmp_path, [6.2, 6.1, 6.238325]), 3, tol)
    assert [r.ok for r in rows] == [True, True, False] and rows[2].non_finite == ["loss A"]
    assert "NOT FINITE" in table(rows, tol).splitlines()[-2]
    assert "first at step 3: side A's loss is not finite (NaN or inf)" in verdict(rows, tol)
    both = compare(side(tmp_path, [6.2, NAN]), side(tmp_path, [6.2, INF]), 2, tol)
    assert not both[1].ok and "on both sides: both diverged, which is no agreement" in verdict(both, tol)
    # an older metrics.jsonl with a bare NaN reads the same
    old = side(tmp_path, [6.2])
    old.records[0]["loss"] = NAN
    assert not compare(old, side(tmp_path, [6.2]), 1, tol)[0].ok
    # every step agrees, but a side ended diverged (its final evaluation or weights)
    agreeing = compare(side(tmp_path, [6.2]), side(tmp_path, [6.2], "diverged"), 1, tol)
    assert verdict(agreeing, tol, ["B"]).startswith("FAIL: 1 steps within tolerance, but side B diverged")


def test_a_diverged_trial_is_pruned(tmp_path):
    from ds_exp.sweeps.study_files import outcome

    write_json_atomic(tmp_path / "summary.json", {"status": "diverged", "error": "Diverged: the loss ..."})
    assert outcome(tmp_path, "final_eval.eval_loss", None)[:3] == ("PRUNED", None, "Diverged: the loss ...")
