"""`python -m ds_exp --help` against a bare Hydra app's `--help`: whole processes, paired and alternating (ds_exp,
bare, ds_exp, bare, ...) so that load on the machine falls on both alike; the median of each and of the ratios.
The bar (issue 22): ds_exp's help no slower than twice Hydra's own. Also `--help zero` (one group in full).

    python -m bench help_time            # 5 pairs (the issue's measure)
    python -m bench.help_time --reps 11
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import env, stats, table, write_result

BARE_APP = """\
import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg: DictConfig) -> None:
    print(cfg)


if __name__ == "__main__":
    main()
"""


def timed(cmd: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return elapsed


def main(quick: bool = False, reps: int = 5) -> dict[str, Any]:
    reps = 3 if quick else reps
    with tempfile.TemporaryDirectory(prefix="ds_exp_bench_help_") as tmp:
        work = Path(tmp)
        (work / "bare_app.py").write_text(BARE_APP)
        ours_cmd = [sys.executable, "-m", "ds_exp", "--help"]
        bare_cmd = [sys.executable, str(work / "bare_app.py"), "--help"]
        group_cmd = [sys.executable, "-m", "ds_exp", "--help", "zero"]
        for cmd in (ours_cmd, bare_cmd):  # warm the file cache and the .pyc files
            timed(cmd, work)
        ours, bare, group = [], [], []
        for _ in range(reps):
            ours.append(timed(ours_cmd, work))
            bare.append(timed(bare_cmd, work))
            group.append(timed(group_cmd, work))
    ratios = [o / b for o, b in zip(ours, bare, strict=True)]
    results = {
        "reps": reps,
        "ds_exp_help_s": stats(ours),
        "bare_hydra_help_s": stats(bare),
        "ds_exp_help_group_s": stats(group),
        "ratio_of_medians": statistics.median(ours) / statistics.median(bare),
        "median_paired_ratio": statistics.median(ratios),
        "paired_ratios": ratios,
        "bar": "ds_exp --help no slower than 2x a bare Hydra app's --help",
    }
    print(
        table(
            ["command", "median s", "min s", "max s"],
            [
                ["python -m ds_exp --help", *_mmm(results["ds_exp_help_s"])],
                ["bare Hydra app --help", *_mmm(results["bare_hydra_help_s"])],
                ["python -m ds_exp --help zero", *_mmm(results["ds_exp_help_group_s"])],
            ],
        )
    )
    print(
        f"\nds_exp / bare Hydra: {results['ratio_of_medians']:.2f}x (medians), "
        f"{results['median_paired_ratio']:.2f}x (median of {reps} paired ratios); the bar is 2x"
    )
    write_result("help_time", results)
    return results


def _mmm(s: dict[str, float]) -> list[float]:
    return [s["median"], s["min"], s["max"]]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    main(quick=args.quick, reps=args.reps)
