"""Sweep report (`python -m ds_exp.report <sweep dir>`, and after every multirun): a row per job, as CSV, Markdown and a
picture; an autotune sweep adds its ranking and the command that trains the best."""

from __future__ import annotations

import csv
import io
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ds_exp.config.ds_config import override_key
from ds_exp.config.memory_plan import human_bytes
from ds_exp.core.files import write_bytes_atomic
from ds_exp.core.status import RunStatus
from ds_exp.sweeps.report_plot import picture, train_curve, varying_overrides
from ds_exp.sweeps.study_files import SESSION_KEYS, study_section

if TYPE_CHECKING:
    from collections.abc import Callable

SCORES = "harness"  # summary.json's lm-eval scores (ds_exp/evaluation/): task -> metric -> value
PREFERENCE = ("reward_accuracy", "reward_margin")  # final_eval of objective=dpo / reward (ds_exp/preference/)
PLAN_FILE = "autotune.json"  # an autotune sweep's plan (ds_exp/tools/autotune.py): candidates, estimates, verdicts

COLUMNS = [
    "job",
    "overrides",
    "status",
    "world_size",
    "dp",
    "sp",
    "zero_stage",
    "tokens_per_s",
    "samples_per_s",
    "peak_memory_mib",
    "peak_memory_mib_per_rank",
    "train_loss",
    "eval_loss",
    "perplexity",
    "wall_time_s",
    "restarts",
    "error_kind",
    "error",
]


def _job_key(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (sys.maxsize, path.name)


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")), key=_job_key)


class Damaged(Exception):
    """A file of a job that cannot be read as what ds_exp wrote there (cut short, edited, another program's)."""


def _read(path: Path, parse: Callable[[str], Any], kind: str) -> Any:
    try:
        return parse(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise Damaged(f"{path} is damaged: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise Damaged(f"{path} is damaged: not valid JSON (line {err.lineno} column {err.colno}: {err.msg})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1} column {mark.column + 1})" if mark is not None else ""
        raise Damaged(f"{path} is damaged: not valid {kind}{where}") from None
    except OSError as err:
        raise Damaged(f"{path} cannot be read ({err.strerror or err})") from None


def read_overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    overrides = _read(path, yaml.safe_load, "YAML") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise Damaged(f"{path} is damaged: Hydra writes a list of overrides there, it holds {type(overrides).__name__}")
    return overrides


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scores(scores: object) -> bool:
    """summary.json's `harness` as a run writes it (eval.harness): task -> metric -> number or null."""
    if not isinstance(scores, dict) or not all(isinstance(metrics, dict) for metrics in scores.values()):
        return False
    return all(v is None or _is_number(v) for metrics in scores.values() for v in metrics.values())


def _numbers(values: object) -> bool:
    return isinstance(values, list) and all(v is None or _is_number(v) for v in values)


class Summary:
    """A job's summary.json, each value type-checked where read: a damaged file costs its row, never the report."""

    def __init__(self, path: Path) -> None:
        data = _read(path, json.loads, "JSON")
        if not isinstance(data, dict):
            raise Damaged(f"{path} is damaged: a JSON {type(data).__name__}, not the object a run writes")
        self.path, self.data = path, data

    def get(self, key: str, fits: Callable[[Any], bool], kind: str) -> Any:
        """The value at the dotted `key` (None where absent), or Damaged naming the key when it is not `kind`."""
        value: Any = self.data
        for depth, part in enumerate(key.split(".")):
            if value is not None and not isinstance(value, dict):
                raise Damaged(f"{self.path} is damaged: {'.'.join(key.split('.')[:depth])} is not an object")
            value = None if value is None else value.get(part)
        if value is not None and not fits(value):
            raise Damaged(f"{self.path} is damaged: {key} is not {kind}")
        return value

    def number(self, key: str) -> Any:
        return self.get(key, _is_number, "a number")

    def text(self, key: str) -> str | None:
        return self.get(key, lambda value: isinstance(value, str), "text")


NUMBERS = ("zero_stage", "tokens_per_s", "samples_per_s", "train_loss", "wall_time_s", "restarts")
PLAN, DRY_RUN = "plan.json", "dry run"  # what dry_run=true leaves instead of summary.json (ds_exp/tools/dry_run.py)


def job_row(job_dir: Path) -> dict[str, Any]:
    """The job's row; a damaged overrides.yaml or summary.json is named in it (status "damaged")."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(job=job_dir.name)
    damaged = []
    try:
        row.update(overrides=" ".join(read_overrides(job_dir)))
    except Damaged as err:
        damaged.append(str(err))
    summary_file = job_dir / "summary.json"
    if not summary_file.is_file() and (job_dir / PLAN).is_file():
        row.update(status=DRY_RUN)  # planned (plan.json, ds_config.json), not trained: nothing failed
    elif not summary_file.is_file():
        row.update(status="no summary", error=f"{summary_file} missing: the job never reached training or was killed")
    else:
        try:
            row.update(_summary_cells(Summary(summary_file)))
        except Damaged as err:
            damaged.append(str(err))
    if damaged:  # a damaged overrides.yaml alone keeps the summary's status: the results are there
        summary_damaged = any(str(summary_file) in d for d in damaged)
        row.update(status="damaged" if summary_damaged else row["status"], error="; ".join(damaged))
    return row


def _summary_cells(summary: Summary) -> dict[str, Any]:
    per_rank = summary.get("peak_memory_bytes_per_rank", _numbers, "a list of numbers") or []
    peaks = [p for p in per_rank if p is not None]
    final = summary.get("final_eval", lambda v: isinstance(v, dict), "an object") or {}
    world = summary.number("world_size")
    dp, sp = summary.number("data_parallel_size"), summary.number("sequence_parallel_size")
    cells = {
        "status": summary.text("status"),
        "world_size": world,
        "dp": world if dp is None else dp,  # summaries from before sequence parallelism
        "sp": (1 if world is not None else None) if sp is None else sp,
        "peak_memory_mib": max(peaks) / 2**20 if peaks else None,
        "peak_memory_mib_per_rank": " ".join(f"{p / 2**20:.0f}" for p in peaks) or None,
        "eval_loss": summary.number("final_eval.eval_loss"),
        "perplexity": summary.number("final_eval.perplexity"),
        "error_kind": summary.text("error_kind"),
        "error": summary.text("error"),
        **{key: summary.number(key) for key in NUMBERS},
        # preference tuning's final_eval (objective=dpo / reward)
        **{name: summary.number(f"final_eval.{name}") for name in PREFERENCE if name in final},
    }
    scores = summary.get(SCORES, _scores, "numbers by task and metric") or {}  # a column per lm-eval score
    cells.update({f"{SCORES}.{task}.{m}": value for task, metrics in scores.items() for m, value in metrics.items()})
    return cells


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict[str, Any]], columns: list[str] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _csv(rows: list[dict[str, Any]], columns: list[str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def write_report(sweep_dir: Path, own: list[Path] | None = None) -> list[dict[str, Any]]:
    """The report of `own` (the sweep's jobs), else every job there; printed even where it cannot be written."""
    found = job_dirs(sweep_dir) if own is None else sorted(own, key=_job_key)
    rows = [job_row(d) for d in found]
    for row in rows:
        if row["status"] == "damaged" or " is damaged: " in (row["error"] or ""):
            print(f"ds_exp: warning: job {row['job']}: {row['error']}; the report says so in its row", file=sys.stderr)
    scored = [name for name in PREFERENCE if any(name in row for row in rows)]
    scored += sorted({key for row in rows for key in row if key.startswith(f"{SCORES}.")})
    at = COLUMNS.index("wall_time_s")  # the scores' columns after the fixed ones, before the error columns
    columns = [*COLUMNS[:at], *scored, *COLUMNS[at:]]
    files: dict[str, str | bytes] = {"report.csv": _csv(rows, columns)}
    tuned = _section(autotune_section, sweep_dir, rows, files)
    study = _section(study_section, sweep_dir)  # an optuna study's trials and its best one (hydra/sweeper=optuna)
    extra = tuned + (f"\n{study}" if study else "")
    files["report.md"] = f"# Sweep {sweep_dir}\n\n{markdown(rows, columns)}\n![sweep](report.png)\n{extra}"
    if rows:
        files["report.png"] = picture(rows, sweep_dir, [train_curve(d) for d in found])
    where = f"{sweep_dir / 'report.md'}; every column: report.csv"
    try:
        for name, content in files.items():
            write_bytes_atomic(sweep_dir / name, content.encode() if isinstance(content, str) else content)
    except OSError as err:  # a read-only sweep directory, a full disk: the report is still printed
        where = f"its files were not written into {sweep_dir}: {err.strerror or err}"
    print(f"ds_exp sweep report ({where}):\n{console_table(rows)}\n{extra}")
    return rows


# what the console shows of each job: the picture's columns (report.md and report.csv have every one)
CONSOLE = {"job": "job", "status": "status", "eval_loss": "eval loss", "tokens_per_s": "tokens/s",
           "peak_memory_mib": "peak MiB/rank", "overrides": "overrides that differ"}  # fmt: skip


def console_table(rows: list[dict[str, Any]]) -> str:
    """The jobs as aligned columns a terminal holds; the rest stay in report.csv and report.md."""
    columns = dict(CONSOLE)
    if not any(row.get("eval_loss") is not None for row in rows):  # no eval set: the train loss, as the picture
        columns = {("train_loss" if key == "eval_loss" else key): name.replace("eval", "train") for key, name in
                   columns.items()}  # fmt: skip
    cells = [
        {**{key: _cell(row.get(key)) for key in columns}, "overrides": varying}
        for row, varying in zip(rows, varying_overrides(rows), strict=True)
    ]
    for cell, row in zip(cells, rows, strict=True):
        if row["status"] != RunStatus.COMPLETED and row.get("error"):
            cell["overrides"] += f"  ({str(row['error']).splitlines()[0][:80]})"
    keys = list(columns)
    widths = {key: max([len(columns[key]), *(len(cell[key]) for cell in cells)]) for key in keys[:-1]}
    lines = ["  ".join(columns[key].ljust(widths.get(key, 0)) for key in keys)]
    lines += ["  ".join(cell[key].ljust(widths.get(key, 0)) for key in keys) for cell in cells]
    return "\n".join(line.rstrip() for line in lines)


def _section(make: Callable[..., str | None], sweep_dir: Path, *args: Any) -> str:
    """A section from its own record; a damaged record costs the section (said in one line), never the job table."""
    try:
        return make(sweep_dir, *args) or ""
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, OSError) as err:
        what = "the autotune ranking" if make is autotune_section else "the optuna study"
        line = f"{what} is left out: a record of it in {sweep_dir} is damaged ({type(err).__name__}: {err})"
        print(f"ds_exp: warning: {line}", file=sys.stderr)
        return f"\n{line[0].upper()}{line[1:]}.\n"


AUTOTUNE_COLUMNS = ["rank", "candidate", "result", "tokens_per_s", "mfu", "estimate_mib", "peak_memory_mib", "job"]
WARMUP_STEPS = 1  # a probe's first step (allocations, first collectives) is not its speed
NOT_TIMED = f"no metric line after its {WARMUP_STEPS} warm-up step(s); give the probes more steps than train.log_every"


def probe_speed(job_dir: Path) -> tuple[float | None, float | None]:
    """Median tokens/s and MFU of a probe's metric lines after its warm-up step (None where none)."""
    path = job_dir / "metrics.jsonl"
    lines = [_json_line(line) for line in path.read_text(errors="replace").splitlines()] if path.is_file() else []
    train = [r for r in lines if r.get("type") == "train" and _is_number(r.get("step"))]
    steps = [
        r for before, r in zip([{"step": 0}, *train], train, strict=False) if before.get("step", 0) >= WARMUP_STEPS
    ]
    speeds = [r["tokens_per_s"] for r in steps if _is_number(r.get("tokens_per_s"))]
    mfus = [r["mfu"] for r in steps if _is_number(r.get("mfu"))]
    return (statistics.median(speeds) if speeds else None, statistics.median(mfus) if mfus else None)


def _json_line(line: str) -> dict[str, Any]:
    """A metric line; {} for one cut short (a probe killed while writing it)."""
    try:
        record = json.loads(line)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def autotune_rows(sweep_dir: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every candidate of an autotune sweep: the probes that completed ranked by tokens/s, then the rest."""
    plan = json.loads((sweep_dir / PLAN_FILE).read_text())
    by_job = {row["job"]: row for row in rows}
    swept = plan["swept"]
    out = []
    for candidate in plan["candidates"]:
        values = dict(o.split("=", 1) for o in candidate["overrides"] if "=" in o)
        estimate = candidate.get("estimate_bytes")
        row: dict[str, Any] = {
            "candidate": " ".join(f"{k}={values[k]}" for k in swept if k in values),
            "overrides": candidate["overrides"],
            "job": candidate["job"],
            "estimate_mib": estimate / 2**20 if estimate is not None else None,
            "rank": None,
            "tokens_per_s": None,
            "mfu": None,
            "peak_memory_mib": None,
        }
        if candidate["verdict"] != "probe":
            row["result"] = f"{candidate['verdict'].replace('_', ' ')}: {candidate['reason']}"
        else:
            job = by_job.get(candidate["job"]) or {"status": "no summary", "error": None, "error_kind": None}
            status = job["status"]
            if status == RunStatus.COMPLETED:
                row["tokens_per_s"], row["mfu"] = probe_speed(sweep_dir / candidate["job"])
                row["result"] = "fits" if row["tokens_per_s"] is not None else "completed, not timed: " + NOT_TIMED
            elif job.get("error_kind") == "out_of_memory":
                row["result"] = "out of memory"
            else:
                row["result"] = f"{status}: {(job.get('error') or '').splitlines()[0] if job.get('error') else ''}"
            row["peak_memory_mib"] = job.get("peak_memory_mib")
        out.append(row)
    ranked = sorted((r for r in out if r["tokens_per_s"] is not None), key=lambda r: -r["tokens_per_s"])
    for number, row in enumerate(ranked, 1):
        row["rank"] = f"{number} (recommended)" if number == 1 else str(number)
    rest = [r for r in out if r["tokens_per_s"] is None]
    return ranked + rest


def train_command(plan: dict[str, Any], overrides: list[str]) -> str:
    """The command training a probe's configuration: its overrides less the probe's keys, through the same launcher."""
    left_out = set(plan["probe_keys"]) | set(SESSION_KEYS)
    kept = [o for o in overrides if override_key(o) not in left_out]
    launcher = plan.get("launcher_overrides") or []
    head = ["python", "-m", "ds_exp", *(["-m", *launcher] if launcher else [])]
    return " ".join(shlex.quote(part) for part in [*head, *kept])


def autotune_section(sweep_dir: Path, rows: list[dict[str, Any]], files: dict[str, str | bytes]) -> str:
    """The ranking of an autotune sweep (for report.md; its CSV added to `files`), or "" for other sweeps."""
    if not (sweep_dir / PLAN_FILE).is_file():
        return ""
    plan = json.loads((sweep_dir / PLAN_FILE).read_text())
    ranked = autotune_rows(sweep_dir, rows)
    files["autotune.csv"] = _csv(ranked, AUTOTUNE_COLUMNS)
    columns = [c for c in AUTOTUNE_COLUMNS if c != "mfu" or any(r["mfu"] is not None for r in ranked)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in ranked]
    head = (
        f"\n## Autotune\n\nWorld size {plan['world_size']} ({plan['accelerator']}), memory budget "
        f"{human_bytes(plan['memory_budget_bytes'])} per rank ({plan['memory_budget_source']}); tokens/s is the median "
        f"of each probe's steps after the first; estimate = model states + activations "
        "(ds_exp/config/memory_plan.py).\n\n"
    )
    if plan["accelerator"] == "cpu" and not plan.get("launcher_overrides"):
        head += (
            "peak_memory_mib is the process's resident peak: with Hydra's basic launcher the probes run one after "
            "another in one process, so it never goes down from one probe to the next.\n\n"
        )
    best = ranked[0] if ranked and ranked[0]["tokens_per_s"] is not None else None
    if best is None:
        tail = f"\n{_no_recommendation(ranked)}: nothing to recommend (see each probe's result above and its logs/).\n"
    else:
        tail = (
            f"\nRecommended: {best['candidate']} ({_cell(best['tokens_per_s'])} tokens/s). Train with it:\n\n"
            f"    {train_command(plan, best['overrides'])}\n"
        )
    return head + "\n".join(lines) + "\n" + tail


def _no_recommendation(ranked: list[dict[str, Any]]) -> str:
    if any(str(r.get("result", "")).startswith("completed, not timed") for r in ranked):
        return f"No probe was timed ({NOT_TIMED})"
    return "No probe completed"


def autotune_verdict(sweep_dir: Path, rows: list[dict[str, Any]]) -> str | None:
    """Why an autotune sweep recommends nothing (its exit is then non-zero), or None when it recommends a probe."""
    ranked = autotune_rows(sweep_dir, rows)
    if any(r["tokens_per_s"] is not None for r in ranked):
        return None
    why = _no_recommendation(ranked)
    return f"{why[0].lower()}{why[1:]}; nothing to recommend"
