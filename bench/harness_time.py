"""What eval.harness costs against the training itself (issue 33): the default run (`python -m ds_exp`, 250 steps of
the tiny model) with `eval.harness.tasks=[ds_exp_synthetic,ds_exp_passkey]`, twice with one data cache: the first
scores the tuned export and the base model (rebuilt from train.seed), the second takes the base's scores from the
cache. Each run's training seconds (its steps' samples over summary.json's samples_per_s) beside the evaluation's
(harness.json timing: the built-in tasks' files, the tuned model, the base), and the run's wall time.

    python -m bench harness_time
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import run, table, write_result

TASKS = "eval.harness.tasks=[ds_exp_synthetic,ds_exp_passkey]"


def main(quick: bool = False) -> dict[str, Any]:
    steps = ["train.max_steps=40"] if quick else []
    rows = []
    with tempfile.TemporaryDirectory(prefix="ds_exp_bench_harness_") as tmp:
        work = Path(tmp)
        cache = work / "cache"
        # tokenize once, outside the measure (both runs then read the tokenized data from the cache)
        run([sys.executable, "-m", "ds_exp", "train.max_steps=1", f"data.cache_dir={cache}", f"hydra.run.dir={work}/w"])
        for name in ("base scored", "base cached"):
            run_dir = work / name.replace(" ", "_")
            wall, _ = run(
                [sys.executable, "-m", "ds_exp", TASKS, *steps, f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}"],
                cwd=work,
            )
            summary = json.loads((run_dir / "summary.json").read_text())
            record = json.loads((run_dir / "eval" / "harness.json").read_text())
            timing = record["timing"]
            evaluation = sum(timing.values())
            batch = json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"]
            train_s = summary["steps"] * batch / summary["samples_per_s"]  # the training loop's own seconds
            rows.append(
                {
                    "run": name,
                    "steps": summary["steps"],
                    "train_s": train_s,
                    "tasks_s": timing["tasks_s"],
                    "tuned_s": timing["tuned_s"],
                    "base_s": timing["base_s"],
                    "evaluation_s": evaluation,
                    "evaluation_over_training": evaluation / train_s,
                    "process_wall_s": wall,
                    "acc": record["tasks"]["ds_exp_synthetic"]["acc"],
                }
            )
    headers = ["run", "steps", "train s", "tasks s", "tuned s", "base s", "evaluation s", "eval / train", "wall s"]
    keys = ["run", "steps", "train_s", "tasks_s", "tuned_s", "base_s", "evaluation_s", "evaluation_over_training"]
    print(table(headers, [[row[k] for k in keys] + [row["process_wall_s"]] for row in rows]))
    payload = {"quick": quick, "tasks": TASKS, "runs": rows}
    print(f"written to {write_result('harness_time', payload)}")
    return payload


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
