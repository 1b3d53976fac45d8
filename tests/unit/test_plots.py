"""Pictures without a tracker (issue 35 §3): a run's plots/loss.png drawn from its metrics.jsonl, a sweep report's
report.png per job, an optuna study's study.png. Real files and real matplotlib; the PNGs are read back."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import optuna
import pytest
import yaml

from ds_exp.artifacts.loss_plot import PLOT, Curves, LossPlot, figure
from ds_exp.config.ds_config import log_interval
from ds_exp.sweeps.optuna_study import write_study
from ds_exp.sweeps.report import write_report
from ds_exp.sweeps.report_plot import figure as report_figure
from ds_exp.sweeps.report_plot import judged_by, plot, train_curve, varying_overrides
from ds_exp.sweeps.study_files import STUDY_PLOT, study_section

PNG = b"\x89PNG\r\n\x1a\n"


def lines(path: Path, *records: dict, tail: str = "") -> None:
    with path.open("a") as file:
        file.write("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_the_loss_plot_draws_what_metrics_jsonl_holds(tmp_path, caplog):
    run_dir = tmp_path / "exp" / "run"
    run_dir.mkdir(parents=True)
    metrics = run_dir / "metrics.jsonl"
    lines(metrics, {"type": "eval", "step": 0, "eval_loss": 6.1}, {"type": "train", "step": 1, "loss": 6.0, "lr": 1e-3})
    lines(metrics, {"type": "harness", "step": 1, "harness/x": 0.5}, tail='{"type": "train", "step": 2, "lo')
    plot = LossPlot(run_dir, enabled=True)
    plot.draw()
    png = (run_dir / PLOT).read_bytes()
    assert png.startswith(PNG) and len(png) > 10_000
    assert (plot.curves.train, plot.curves.lr, plot.curves.eval) == ([(1, 6.0)], [(1, 1e-3)], [(0, 6.1)])
    # the line being written is read once it is whole; a diverged step (null, ds_exp/core/files.py) is a gap
    with metrics.open("a") as file:
        file.write('ss": 5.5, "lr": 0.001}\n')
    lines(metrics, {"type": "train", "step": 3, "loss": None, "lr": 1e-3})
    plot.draw(final=True)  # an evaluation's picture this soon would be skipped: the end's never is
    assert [s for s, _ in plot.curves.train] == [1, 2, 3] and plot.curves.train[1] == (2, 5.5)
    assert plot.curves.train[2][1] != plot.curves.train[2][1]  # NaN
    # a resume sets aside the lines past its checkpoint (the file gets shorter): read again from the start
    metrics.write_text(json.dumps({"type": "train", "step": 1, "loss": 4.0, "lr": 1e-3}) + "\n")
    plot.draw(final=True)
    assert plot.curves.train == [(1, 4.0)] and plot.curves.eval == []
    # an evaluation's picture right after the last one is skipped (at most 2% of the run's time), and so is the
    # end's when no line came since (the end right after the last evaluation's picture)
    before = (run_dir / PLOT).stat().st_mtime_ns
    lines(metrics, {"type": "eval", "step": 1, "eval_loss": 4.5})
    plot.draw()
    assert (run_dir / PLOT).stat().st_mtime_ns == before
    plot.draw(final=True)
    after = (run_dir / PLOT).stat().st_mtime_ns
    plot.draw(final=True)
    assert before < after == (run_dir / PLOT).stat().st_mtime_ns and plot.curves.eval == [(1, 4.5)]
    # a run that wrote no metric line has no picture, and rank > 0 draws nothing
    (tmp_path / "exp" / "early").mkdir()
    LossPlot(tmp_path / "exp" / "early", enabled=True).draw(final=True)
    LossPlot(tmp_path / "exp" / "rank1", enabled=False).draw(final=True)
    assert not (tmp_path / "exp" / "early" / "plots").exists() and not (tmp_path / "exp" / "rank1").exists()
    # a picture that cannot be written costs the picture, said once, never the run
    broken = tmp_path / "exp" / "broken"
    (broken / "plots").parent.mkdir()
    (broken / "plots").write_text("a file where the plots directory goes")
    lines(broken / "metrics.jsonl", {"type": "train", "step": 1, "loss": 6.0, "lr": 1e-3})
    failing = LossPlot(broken, enabled=True)
    with caplog.at_level(logging.WARNING):
        failing.draw(final=True)
        failing.draw(final=True)
    said = [r.getMessage() for r in caplog.records if "was not drawn" in r.getMessage()]
    assert len(said) == 1 and "metrics.jsonl has every line" in said[0]
    assert not list(broken.glob("plots*.tmp")) and not list(broken.rglob(".*.tmp"))


def test_a_short_run_draws_a_curve_its_evaluations_as_points_and_an_honest_lr_axis(compose_cfg):
    """(issue 41 §2) A 10-step run logs every step (about 50 lines a run unless train.log_every is set), so its
    picture is a curve, not a lone dot; its two evaluations are points with their values, not a diagonal; a
    constant learning rate is a flat line on an axis from 0, not the middle of one from -0.04 to 0.04."""
    train = compose_cfg().train
    assert (log_interval(train, 10), log_interval(train, 250), log_interval(train, 1000)) == (1, 5, 20)
    assert log_interval(compose_cfg("train.log_every=10").train, 12) == 10
    curves = Curves()
    for step in range(1, 11):
        curves.add({"type": "train", "step": step, "loss": 3 - step / 10, "lr": 2e-5})
    for step, loss in ((0, 3.2), (10, 2.1)):
        curves.add({"type": "eval", "step": step, "eval_loss": loss})
    loss_axis, lr_axis = figure(curves, "run").axes
    train_line, eval_points = loss_axis.get_lines()
    assert (train_line.get_marker(), train_line.get_linestyle()) == ("o", "-")  # each of 10 points, on its line
    assert (eval_points.get_marker(), eval_points.get_linestyle()) == ("o", "None")
    assert [text.get_text() for text in loss_axis.texts] == ["3.200", "2.100"]
    assert lr_axis.get_ylim() == pytest.approx((0, 2e-5 * 1.08))
    long = Curves(train=[(step, 1.0) for step in range(1, 51)])  # the default run's 50 lines: a line alone
    (line,) = figure(long, "run").axes[0].get_lines()
    assert (line.get_marker(), line.get_linestyle()) == ("None", "-")


def png_size(path: Path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])  # the IHDR chunk: width, height


def job(sweep: Path, number: int, overrides: list[str], summary: dict | None) -> Path:
    directory = sweep / str(number)
    (directory / ".hydra").mkdir(parents=True)
    (directory / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if summary is not None:
        (directory / "summary.json").write_text(json.dumps(summary))
    return directory


def completed(eval_loss: float | None, tokens_per_s: float) -> dict:
    final = {"eval_loss": eval_loss, "perplexity": 2.0} if eval_loss is not None else None
    return {
        "status": "completed",
        "world_size": 1,
        "tokens_per_s": tokens_per_s,
        "train_loss": 3.0,
        "peak_memory_bytes_per_rank": [2**30],
        "final_eval": final,
    }


def test_the_sweep_report_plots_eval_loss_per_job_labelled_by_what_differs(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    job(sweep, 0, ["optimizer.lr=0.0006646813937221444", "zero=stage2", "train.max_steps=8"], completed(3.5, 900.0))
    job(sweep, 1, ["optimizer.lr=3e-4", "zero=stage3", "train.max_steps=8"], completed(3.2, 800.0))
    job(sweep, 2, ["optimizer.lr=1e-2", "zero=stage3", "train.max_steps=8"], {"status": "failed", "error": "oom"})
    for number, losses in enumerate(([6.0, 4.0, 3.5], [6.0, 5.0, 3.2], [6.0, None])):
        train = [{"type": "train", "step": step, "loss": loss} for step, loss in enumerate(losses, 1)]
        lines(sweep / str(number) / "metrics.jsonl", *train, {"type": "eval", "step": 3, "eval_loss": 1.0})
    rows = write_report(sweep)
    assert (sweep / "report.png").read_bytes().startswith(PNG)
    # the console's table: the picture's columns, fit for a terminal; every column stays in report.csv (§9)
    assert capsys.readouterr().out.splitlines()[1:5] == [
        "job  status     eval loss  tokens/s  peak MiB/rank  overrides that differ",
        "0    completed  3.5        900       1024           optimizer.lr=0.0006647 zero=stage2",
        "1    completed  3.2        800       1024           optimizer.lr=3e-4 zero=stage3",
        "2    failed                                         optimizer.lr=1e-2 zero=stage3  (oom)",
    ]
    assert len((sweep / "report.csv").read_text().splitlines()[0].split(",")) >= 18
    # the jobs' train loss curves overlaid below the bars (issue 41 §2): a diverged step is a gap
    assert train_curve(sweep / "0") == [(1, 6.0), (2, 4.0), (3, 3.5)] and train_curve(sweep / "2")[1][1] != 6.0
    plot(rows, tmp_path / "bars.png", sweep)  # without the curves
    assert png_size(sweep / "report.png")[1] >= png_size(tmp_path / "bars.png")[1] + 350
    assert [r["eval_loss"] for r in rows] == [3.5, 3.2, None]  # the report's own column too
    # only the overrides that differ, a drawn number to 4 digits: labels a person reads
    assert varying_overrides(rows) == ["optimizer.lr=0.0006647 zero=stage2", "optimizer.lr=3e-4 zero=stage3",
                                       "optimizer.lr=1e-2 zero=stage3"]  # fmt: skip
    panel = judged_by(rows, sweep)
    assert (panel.title, panel.values, panel.lower_is_better) == ("final eval loss (lower is better)", [3.5, 3.2, None],
                                                                  True)  # fmt: skip
    no_eval = [{**r, "eval_loss": None} for r in rows]  # no job has an eval set: the train loss
    assert judged_by(no_eval, None).title == "train loss (lower is better)"


def test_a_failed_or_diverged_job_is_never_ranked_in_any_panel(tmp_path):
    """(issue 39 §6) The fastest job, with the lowest eval loss, diverged: each panel's green is the best job that
    completed; the diverged job is red in every panel, its values marked with how it ended, and a job that failed
    before any value says why in place of its bars."""
    from matplotlib.colors import to_hex

    sweep = tmp_path / "sweep"
    job(sweep, 0, ["optimizer.lr=1e-4"], completed(3.5, 900.0))
    job(sweep, 1, ["optimizer.lr=1e-3"], completed(3.2, 800.0))
    diverged = {**completed(0.5, 5000.0), "status": "diverged", "error_kind": "diverged", "error": "Diverged: nan"}
    job(sweep, 2, ["optimizer.lr=1"], diverged)
    job(sweep, 3, ["optimizer.lr=2"], {"status": "failed", "error_kind": "out_of_memory", "error": "OOM"})
    rows = write_report(sweep)
    assert (sweep / "report.png").read_bytes().startswith(PNG)
    axes = report_figure(rows, sweep).axes
    green, blue, red = (to_hex(name) for name in ("tab:green", "tab:blue", "tab:red"))
    assert [[to_hex(bar.get_facecolor()) for bar in ax.patches] for ax in axes] == [
        [blue, green, red, red],  # final eval loss: 3.2 is the best that completed, not the diverged 0.5
        [green, blue, red, red],  # tokens/s: 900, not the diverged 5000
        [blue, blue, red, red],  # memory: never ranked
    ]
    tokens = axes[1]
    assert "5000 (diverged)" in [text.get_text() for text in tokens.texts]
    assert " out_of_memory" in [text.get_text() for text in tokens.texts]


def test_a_study_plots_its_objective_against_each_searched_parameter(tmp_path):
    sweep = tmp_path / "study"
    study = optuna.create_study(direction="maximize", study_name="demo")
    space = {
        "optimizer.lr": optuna.distributions.FloatDistribution(1e-5, 1e-2, log=True),
        "zero": optuna.distributions.CategoricalDistribution(["stage2", "stage3"]),
    }
    identity = {"study_name": "demo", "storage": "memory", "objective": "tokens_per_s", "direction": "maximize"}
    sweep.mkdir()
    write_study(sweep, study, identity, 3)  # no trial completed yet: no picture
    assert not (sweep / STUDY_PLOT).exists()
    for number, value in enumerate((900.0, 1200.0, 1000.0)):
        trial = study.ask(space)
        overrides = [f"optimizer.lr={trial.params['optimizer.lr']}", f"zero={trial.params['zero']}"]
        trial.set_user_attr("job_dir", str(job(sweep, number, overrides, completed(3.0, value))))
        trial.set_user_attr("overrides", overrides)
        study.tell(trial, value)
    write_study(sweep, study, identity, 3)
    assert (sweep / STUDY_PLOT).read_bytes().startswith(PNG)
    # trial 0 is drawn in a blue that shows on the grey, not in Blues' first colour, white (issue 41 §10)
    import matplotlib
    from matplotlib.image import imread

    pixels, white_blue = imread(sweep / STUDY_PLOT)[..., :3], matplotlib.colormaps["Blues"](0.0)[:3]
    assert not (abs(pixels - white_blue) < 0.01).all(axis=-1).any()
    assert f"]({STUDY_PLOT})" in (study_section(sweep) or "")
    panel = judged_by(write_report(sweep), sweep)  # the report's picture is judged by the study's objective
    assert (panel.title, panel.values, panel.lower_is_better) == ("tokens_per_s (maximize)", [900.0, 1200.0, 1000.0],
                                                                  False)  # fmt: skip


def test_a_damaged_study_record_leaves_the_report_picture_to_the_eval_loss(tmp_path):
    sweep = tmp_path / "sweep"
    job(sweep, 0, ["zero=stage2"], completed(3.5, 900.0))
    (sweep / "study.json").write_text('{"objective": "x"}')  # cut short or edited: no trials
    assert judged_by(write_report(sweep), sweep).title == "final eval loss (lower is better)"
