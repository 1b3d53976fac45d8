"""`python -m ds_exp.report DIR`: the runs under DIR, one line each, so that a person can tell them apart.

A run is a directory holding `.hydra/overrides.yaml`; a sweep directory gets its sweep report written instead."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ds_exp.core.status import RunStatus
from ds_exp.launch.console import entry_point
from ds_exp.launch.flags import FlagParser, path
from ds_exp.launch.lock import live_holder
from ds_exp.sweeps.report import DRY_RUN, PLAN, Damaged, Summary, job_dirs, read_overrides, write_report

# What a run holds that is not another run: never looked into (a checkpoint directory alone can hold thousands)
_NOT_RUNS = {".hydra", "checkpoints", "logs", "wandb", "tensorboard", "mlartifacts", "attempts", "plots"}
COLUMNS = ("run", "status", "steps", "final eval", "overrides")


def is_sweep(directory: Path) -> bool:
    """A sweep's directory: Hydra's multirun.yaml in it, or jobs named by their number (hydra.sweep.subdir)."""
    jobs = job_dirs(directory)
    return bool(jobs) and ((directory / "multirun.yaml").is_file() or all(job.name.isdigit() for job in jobs))


def find_runs(root: Path) -> list[Path]:
    """The runs below `root` (and `root` itself when it is one), in path order: by date and time under outputs/."""
    found = []
    for folder, subdirs, _ in os.walk(root):
        here = Path(folder)
        if os.path.isfile(here / ".hydra" / "overrides.yaml"):  # False where it cannot be looked at
            found.append(here)
        subdirs[:] = sorted(d for d in subdirs if d not in _NOT_RUNS and not d.startswith(("hf_model", ".")))
    return sorted(found)


def run_line(run_dir: Path, root: Path) -> dict[str, str]:
    """One run's cells: a file it cannot read is said in its status, and the listing goes on."""
    shown = str(run_dir.relative_to(root)) if run_dir != root else str(run_dir)
    row = {"run": shown, "status": "", "steps": "", "final eval": "", "overrides": ""}
    try:
        row["overrides"] = " ".join(read_overrides(run_dir)) or "(defaults)"
    except Damaged as err:
        row["overrides"] = str(err)
    path = run_dir / "summary.json"
    if not os.path.isfile(path):
        holder = live_holder(run_dir)
        never = DRY_RUN if (run_dir / PLAN).is_file() else "no summary (killed, or never started)"
        row["status"] = f"running ({holder})" if holder else never
        return row
    try:
        summary = Summary(path)
        status, error = summary.text("status"), summary.text("error")
        row.update(status=str(status), steps=_steps(summary), **{"final eval": _final_eval(summary)})
    except Damaged as err:
        row["status"] = f"damaged: {err}"
        return row
    if status != RunStatus.COMPLETED and error:
        row["status"] += f": {error.splitlines()[0][:80]}"
    return row


def _steps(summary: Summary) -> str:
    steps, total = summary.number("steps"), summary.number("total_steps")
    if steps is None:
        return "-"
    return f"{steps}/{total}" if total is not None else str(steps)


def _final_eval(summary: Summary) -> str:
    loss = summary.number("final_eval.eval_loss")
    if loss is None:
        return "-"
    accuracy, perplexity = summary.number("final_eval.reward_accuracy"), summary.number("final_eval.perplexity")
    if accuracy is not None:  # preference tuning
        return f"loss {loss:.4f}, accuracy {accuracy:.3f}"
    return f"loss {loss:.4f}, ppl {perplexity:.3f}" if perplexity is not None else f"loss {loss:.4f}"


def listing(rows: list[dict[str, str]]) -> str:
    """The rows as aligned columns; the overrides (the longest) last, unaligned."""
    widths = {c: max([len(c), *(len(r[c]) for r in rows)]) for c in COLUMNS[:-1]}
    lines = ["  ".join(c.ljust(widths[c]) if c in widths else c for c in COLUMNS)]
    lines += ["  ".join(r[c].ljust(widths[c]) if c in widths else r[c] for c in COLUMNS) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


@entry_point("ds_exp.report")
def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(prog="python -m ds_exp.report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "directory",
        type=path,
        help="any directory of runs (outputs/, outputs/<experiment>): they are listed; or a sweep directory "
        "(outputs/multirun/<name>/<time>): its report is written",
    )
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        what = "is not a directory" if args.directory.exists() else "does not exist"
        print(f"ds_exp: error: {args.directory} {what}; give a directory of runs, e.g. outputs/", file=sys.stderr)
        return 2
    if is_sweep(args.directory):  # its report, as at the end of the sweep
        rows = write_report(args.directory)
        return 0 if all(row["status"] in (RunStatus.COMPLETED, DRY_RUN) for row in rows) else 1
    runs = find_runs(args.directory)
    if not runs:
        print(
            f"ds_exp: error: {args.directory} holds no ds_exp runs (no .hydra/overrides.yaml in it or below it)",
            file=sys.stderr,
        )
        return 2
    print(listing([run_line(run, args.directory) for run in runs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
