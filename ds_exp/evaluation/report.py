"""What an lm-eval scoring leaves: RUN_DIR/eval/harness.json ({"tasks": {task: {metric: {"base", "tuned", "stderr"}}},
"settings"}), harness.png, lm-eval's files under {tuned,base}/<TASK>/, the console table."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ds_exp.config.secrets import redact
from ds_exp.core.files import write_json_atomic
from ds_exp.evaluation.fit import FEW_QUESTIONS
from ds_exp.launch.run_logging import quiet_matplotlib

HARNESS_JSON = "harness.json"
CHART = "harness.png"
OWN = (HARNESS_JSON, CHART, "tuned", "base", "lm_eval.log")  # what one evaluation writes into its directory
EARLIER = "earlier"


def harness_record(
    tuned: dict[str, dict[str, tuple[float | None, float | None]]],
    base: dict[str, dict[str, tuple[float | None, float | None]]] | None,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """harness.json: per result name and metric, the tuned value, its stderr, and the base's when scored."""
    tasks: dict[str, dict[str, dict[str, float | None]]] = {}
    for task, metrics in tuned.items():
        for metric, (value, stderr) in metrics.items():
            entry: dict[str, float | None] = {"tuned": value, "stderr": stderr}
            if base is not None:
                entry = {"base": (base.get(task) or {}).get(metric, (None, None))[0], **entry}
            tasks.setdefault(task, {})[metric] = entry
    return {"tasks": tasks, "settings": settings}


def flat(record: dict[str, Any], side: str) -> dict[str, dict[str, float | None]]:
    """summary.json's `harness` or `harness_base`: task -> metric -> value (objective harness.<task>.<metric>)."""
    return {
        task: {metric: entry.get(side) for metric, entry in metrics.items()}
        for task, metrics in record["tasks"].items()
        if any(side in entry for entry in metrics.values())
    }


def tracker_metrics(record: dict[str, Any]) -> dict[str, float]:
    """What the trackers log: harness/<task>/<metric> (tuned) and harness_base/<task>/<metric>."""
    out = {}
    for task, metrics in record["tasks"].items():
        for metric, entry in metrics.items():
            for side, prefix in (("tuned", "harness"), ("base", "harness_base")):
                if isinstance(entry.get(side), (int, float)):
                    out[f"{prefix}/{task}/{metric}"] = float(entry[side])
    return out


def _cell(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def table(record: dict[str, Any]) -> str:
    """The console's table: task, metric, base, tuned, difference, stderr, and the questions the scores rest on."""
    rows = [("task", "metric", "base", "tuned", "difference", "stderr", "questions")]
    questions = record.get("questions") or {}
    for task, metrics in record["tasks"].items():
        for metric, entry in metrics.items():
            base, tuned = entry.get("base"), entry.get("tuned")
            diff = tuned - base if base is not None and tuned is not None else None
            shown = (_cell(base), _cell(tuned), _cell(diff, signed=True), _cell(entry["stderr"]))
            rows.append((task, metric, *shown, str(questions.get(task, "-"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def few_questions(record: dict[str, Any], limit_key: str) -> list[str]:
    """A warning for each score that rests on so few questions that a difference is mostly chance."""
    return [
        f"{task}'s scores rest on {n} question{'s' if n != 1 else ''}: too few to tell a model from another (chance "
        f"alone moves them by more than the difference); score more of them ({limit_key}, or all)"
        for task, n in (record.get("questions") or {}).items()
        if n < FEW_QUESTIONS
    ]


def chart(record: dict[str, Any], path: Path, title: str) -> None:
    """Bars of base against tuned for every task and metric (the tuned alone for one model)."""
    quiet_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = record["tasks"].items()
    pairs = [(f"{task}\n{metric}", entry) for task, metrics in tasks for metric, entry in metrics.items()]
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(pairs) + 2), 4.5))
    sides = [side for side in ("base", "tuned") if any(side in entry for _, entry in pairs)]
    width = 0.8 / len(sides)
    for n, side in enumerate(sides):
        values = [entry.get(side) or 0.0 for _, entry in pairs]
        errors = [entry.get("stderr") or 0.0 if side == "tuned" else 0.0 for _, entry in pairs]
        bars = ax.bar(
            [i + (n - (len(sides) - 1) / 2) * width for i in range(len(pairs))],
            values,
            width,
            yerr=errors,
            label=side,
            color="tab:gray" if side == "base" else "tab:blue",
        )
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_xticks(range(len(pairs)), [label for label, _ in pairs], fontsize=8)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """A scratch directory moved into `target` when the block completes (earlier files set aside)."""
    made = [p for p in (target.parent, target) if not p.exists()]
    target.mkdir(parents=True, exist_ok=True)
    scratch = target / f".staging-{time.strftime('%Y%m%d-%H%M%S')}-{id(target):x}"
    scratch.mkdir()
    try:
        yield scratch
        earlier = [target / name for name in OWN if (target / name).exists()]
        if earlier:
            aside = target / EARLIER / time.strftime("%Y-%m-%d_%H-%M-%S")
            aside.mkdir(parents=True, exist_ok=True)
            for path in earlier:
                path.rename(aside / path.name)
        for path in scratch.iterdir():
            path.rename(target / path.name)
        scratch.rmdir()
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        for path in reversed(made):
            with contextlib.suppress(OSError):
                path.rmdir()  # only when empty: what else is there stays
        raise


def write_record(directory: Path, record: dict[str, Any], title: str) -> None:
    write_json_atomic(directory / HARNESS_JSON, redact(record))
    chart(record, directory / CHART, title)
