"""Sweep report: one row per job of a multirun, printed and written as CSV, Markdown and a PNG plot.

    python -m ds_exp.report <sweep dir>

Runs by itself at the end of every multirun (the `SweepReport` callback in conf/config.yaml). A job that
failed shows its error; a job that left no summary.json (killed, never started) says so.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

import yaml

COLUMNS = [
    "job",
    "overrides",
    "status",
    "world_size",
    "zero_stage",
    "tokens_per_s",
    "samples_per_s",
    "peak_memory_mib",
    "peak_memory_mib_per_rank",
    "train_loss",
    "perplexity",
    "wall_time_s",
    "restarts",
    "error",
]


def _job_key(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (sys.maxsize, path.name)


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")), key=_job_key)


def job_row(job_dir: Path) -> dict[str, Any]:
    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(job=job_dir.name, overrides=" ".join(overrides))
    summary_file = job_dir / "summary.json"
    if not summary_file.is_file():
        row.update(status="no summary", error=f"{summary_file} missing: the job never reached training or was killed")
        return row
    summary = json.loads(summary_file.read_text())
    peaks = [p for p in summary.get("peak_memory_bytes_per_rank") or [] if p is not None]
    final = summary.get("final_eval") or {}
    row.update(
        status=summary.get("status"),
        world_size=summary.get("world_size"),
        zero_stage=summary.get("zero_stage"),
        tokens_per_s=summary.get("tokens_per_s"),
        samples_per_s=summary.get("samples_per_s"),
        peak_memory_mib=max(peaks) / 2**20 if peaks else None,
        peak_memory_mib_per_rank=" ".join(f"{p / 2**20:.0f}" for p in peaks) or None,
        train_loss=summary.get("train_loss"),
        perplexity=final.get("perplexity"),
        wall_time_s=summary.get("wall_time_s"),
        restarts=summary.get("restarts"),
        error=summary.get("error"),
    )
    return row


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def varying_overrides(rows: list[dict[str, Any]]) -> list[str]:
    """Per job, only the overrides that differ between jobs (what the sweep varies), for short labels."""
    parsed = [dict(item.split("=", 1) for item in (row["overrides"] or "").split() if "=" in item) for row in rows]
    keys = sorted({k for p in parsed for k in p if len({q.get(k) for q in parsed}) > 1})
    return [
        " ".join(f"{k}={p[k]}" for k in keys if k in p) or f"job {row['job']}"
        for p, row in zip(parsed, rows, strict=True)
    ]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Throughput and peak memory per job, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = varying_overrides(rows)
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 4.5))
    for ax, key, title in (
        (axes[0], "tokens_per_s", "tokens/s (all ranks)"),
        (axes[1], "peak_memory_mib", "peak memory per rank (MiB)"),
    ):
        values = [row[key] or 0.0 for row in rows]
        bars = ax.bar(
            range(len(rows)), values, color=["tab:blue" if r["status"] == "completed" else "tab:red" for r in rows]
        )
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
    fig.suptitle("ds_exp sweep (red: failed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(sweep_dir: Path) -> list[dict[str, Any]]:
    rows = [job_row(d) for d in job_dirs(sweep_dir)]
    with (sweep_dir / "report.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    table = markdown(rows)
    from ds_exp.study_record import study_section

    study = study_section(sweep_dir)  # an optuna study's trials and its best one (hydra/sweeper=optuna)
    study = f"\n{study}" if study else ""
    (sweep_dir / "report.md").write_text(f"# Sweep {sweep_dir}\n\n{table}\n![sweep](report.png)\n{study}")
    if rows:
        plot(rows, sweep_dir / "report.png")
    print(f"ds_exp sweep report ({sweep_dir / 'report.md'}):\n{table}{study}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_exp.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory (outputs/multirun/<name>/<time>)")
    args = parser.parse_args(argv)
    if not job_dirs(args.sweep_dir):
        print(f"ds_exp: error: {args.sweep_dir} holds no sweep jobs (no */.hydra/overrides.yaml)", file=sys.stderr)
        return 2
    rows = write_report(args.sweep_dir)
    return 0 if all(row["status"] == "completed" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
