"""report.png: a row per job with what the sweep is judged by, its tokens/s and peak memory (the best green, unfinished
jobs saying why), the train loss curves below; drawn without pyplot, written whole."""

from __future__ import annotations

import io
import json
import math
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

from ds_exp.core.files import write_bytes_atomic
from ds_exp.core.status import RunStatus
from ds_exp.launch.run_logging import quiet_matplotlib
from ds_exp.sweeps.study_files import study_values

LABEL_WIDTH = 44  # characters of a job's label per line


class Panel(NamedTuple):
    title: str
    values: list[float | None]  # one per job, None where it has none
    lower_is_better: bool | None  # None: no job is "best" by it (memory)


def varying_overrides(rows: list[dict[str, Any]]) -> list[str]:
    """Per job, only the overrides that differ between jobs (what the sweep varies), for short labels."""
    parsed = [dict(item.split("=", 1) for item in (row["overrides"] or "").split() if "=" in item) for row in rows]
    keys = sorted({k for p in parsed for k in p if len({q.get(k) for q in parsed}) > 1})
    return [
        " ".join(f"{k}={_short(p[k])}" for k in keys if k in p) or f"job {row['job']}"
        for p, row in zip(parsed, rows, strict=True)
    ]


def _short(value: str) -> str:
    """A number an optuna study drew (optimizer.lr=0.0006646813937221444) to 4 significant digits; the rest as is."""
    try:
        number = float(value)
    except ValueError:
        return value
    return f"{number:.4g}" if len(value) > 8 and math.isfinite(number) else value


def job_labels(rows: list[dict[str, Any]]) -> list[str]:
    """`<job>: <the overrides that differ>`, wrapped to fit beside the bars."""
    return [
        "\n".join(textwrap.wrap(f"{row['job']}: {varying}", LABEL_WIDTH, break_on_hyphens=False)[:4])
        for row, varying in zip(rows, varying_overrides(rows), strict=True)
    ]


def judged_by(rows: list[dict[str, Any]], sweep_dir: Path | None) -> Panel:
    """An optuna study's objective, else the final eval loss, else the train loss."""
    try:
        study = study_values(sweep_dir) if sweep_dir is not None else None
    except (ValueError, KeyError, TypeError, OSError):
        study = None  # a damaged record: the report's study section says so
    if study is not None:
        objective, direction, by_job = study
        return Panel(f"{objective} ({direction})", [by_job.get(row["job"]) for row in rows], direction != "maximize")
    if any(_number(row.get("eval_loss")) is not None for row in rows):
        return Panel("final eval loss (lower is better)", [_number(row.get("eval_loss")) for row in rows], True)
    return Panel("train loss (lower is better)", [_number(row.get("train_loss")) for row in rows], True)


def _number(value: object) -> float | None:
    finite = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if finite else None  # type: ignore[arg-type]


Curve = list[tuple[int, float]]  # (optimizer step, train loss)


def train_curve(job_dir: Path) -> Curve:
    """A job's train loss by step, from its metrics.jsonl (empty without one; a line that is not JSON is skipped)."""
    try:
        text = (job_dir / "metrics.jsonl").read_text(errors="replace")
    except OSError:
        return []
    curve = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("type") == "train" and isinstance(record.get("step"), int):
            loss = _number(record.get("loss"))
            curve.append((record["step"], math.nan if loss is None else loss))
    return curve


def figure(rows: list[dict[str, Any]], sweep_dir: Path | None = None, curves: list[Curve] | None = None) -> Any:
    """The picture of the report's `rows`; `sweep_dir`: where a study's record is; `curves`: each job's train loss."""
    quiet_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [
        judged_by(rows, sweep_dir),
        Panel("tokens/s, all ranks (higher is better)", [_number(row.get("tokens_per_s")) for row in rows], False),
        Panel("peak memory per rank (MiB)", [_number(row.get("peak_memory_mib")) for row in rows], None),
    ]
    labels = job_labels(rows)
    bars_height = max(3.0, 0.2 + 0.32 * sum(label.count("\n") + 1.6 for label in labels))
    drawn = [curve for curve in curves or [] if curve]
    figure = Figure(figsize=(15, bars_height + (4.0 if drawn else 0)), dpi=100)
    FigureCanvasAgg(figure)
    top: Any = figure
    bottom: Any = None
    if drawn:
        parts: Any = figure.subfigures(2, 1, height_ratios=[bars_height, 4.0])  # matplotlib's stubs: one or an array
        top, bottom = parts
    axes = top.subplots(1, len(panels), sharey=True)
    positions = list(range(len(rows)))
    for ax, panel in zip(axes, panels, strict=True):
        _bars(ax, panel, rows, positions)
    axes[0].set_yticks(positions, labels, fontsize=8)
    axes[0].invert_yaxis()  # job 0 on top, as in the report's table
    if bottom is not None and curves is not None:
        _curves(bottom.subplots(), curves, varying_overrides(rows), rows)
    top.suptitle(f"ds_exp sweep: {len(rows)} jobs (green: best; red: did not complete)", fontsize=11)
    if bottom is None:
        figure.tight_layout()
    else:
        top.subplots_adjust(left=0.2, right=0.98, top=1 - 0.55 / bars_height, bottom=0.4 / bars_height, wspace=0.15)
        bottom.subplots_adjust(left=0.2, right=0.98, top=0.92, bottom=0.14)
    return figure


def picture(rows: list[dict[str, Any]], sweep_dir: Path | None = None, curves: list[Curve] | None = None) -> bytes:
    out = io.BytesIO()
    figure(rows, sweep_dir, curves).savefig(out, format="png", dpi=100)
    return out.getvalue()


def plot(
    rows: list[dict[str, Any]], path: Path, sweep_dir: Path | None = None, curves: list[Curve] | None = None
) -> None:
    """report.png at `path`, written whole (ds_exp/core/files.py)."""
    write_bytes_atomic(path, picture(rows, sweep_dir, curves))


def _bars(ax: Any, panel: Panel, rows: list[dict[str, Any]], positions: list[int]) -> None:
    """A bar per job: the best completed one green (a diverged or failed job is never ranked), an unfinished one red."""
    done = [row["status"] == RunStatus.COMPLETED for row in rows]
    known = [v for v, ok in zip(panel.values, done, strict=True) if v is not None and ok]
    best = None if panel.lower_is_better is None or not known else (min if panel.lower_is_better else max)(known)
    colors = [
        "tab:red" if not ok else "tab:green" if v is not None and v == best else "tab:blue"
        for v, ok in zip(panel.values, done, strict=True)
    ]
    bars = ax.barh(positions, [v or 0.0 for v in panel.values], color=colors)
    why = [row.get("error_kind") or row["status"] for row in rows]
    shown = [
        _shown(v) + ("" if ok or v is None else f" ({w})") for v, ok, w in zip(panel.values, done, why, strict=True)
    ]
    ax.bar_label(bars, shown, fontsize=8, padding=2)
    for position, value, ok, said in zip(positions, panel.values, done, why, strict=True):
        if value is None and not ok:
            ax.text(0, position, f" {said}", color="tab:red", va="center", fontsize=8)
    ax.set_title(panel.title, fontsize=9)
    ax.margins(x=0.18)
    ax.grid(axis="x", alpha=0.3)


def _curves(ax: Any, curves: list[Curve], varying: list[str], rows: list[dict[str, Any]]) -> None:
    """Every job's train loss by step on one axis, a line per job named as its bars are."""
    for curve, label, row in zip(curves, varying, rows, strict=True):
        if curve:
            steps, losses = zip(*curve, strict=True)
            style = {"marker": "o", "markersize": 3} if len(steps) < 30 else {}
            ax.plot(steps, losses, linewidth=1.2, label=f"{row['job']}: {label}"[:60], **style)
    ax.set_title("train loss by optimizer step", fontsize=9)
    ax.set_xlabel("optimizer step", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", ncol=1 + len(rows) // 10)


def _shown(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.4g}"
