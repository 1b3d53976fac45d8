"""Hydra callbacks for multiruns (registered in conf/config.yaml under hydra.callbacks).

* `ValidateSweep`: before anything is launched or queued, composes and validates every job of the sweep,
  so one bad combination fails the sweep at once with the job's overrides named.
* `SweepReport`: after the last job, writes the sweep report (ds_exp/report.py) and exits non-zero when a
  job failed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def sweep_jobs(config: DictConfig) -> list[list[str]] | None:
    """Each job's overrides, as Hydra's basic sweeper will expand them; None for other sweepers."""
    from ds_exp import compat

    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    params = config.hydra.sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=True) if params else {}
    overrides = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
    return compat.basic_sweep_jobs(overrides)


class ValidateSweep(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra

        from ds_exp.config.schema import to_config
        from ds_exp.config.validate import validate
        from ds_exp.errors import DsExpError
        from ds_exp.secrets import redact_text

        jobs = sweep_jobs(config)
        if not jobs:
            return
        loader = GlobalHydra.instance().config_loader()
        problems = []
        for overrides in jobs:
            try:
                validate(to_config(loader.load_sweep_config(config, list(overrides))))
            except DsExpError as err:
                problems += [f"job [{' '.join(overrides)}]: {line}" for line in str(err).splitlines()]
            except Exception as err:  # composition errors (unknown option, wrong type) from Hydra / OmegaConf
                problems.append(f"job [{' '.join(overrides)}]: {err}".splitlines()[0])
        if problems:
            print(
                f"ds_exp: error: the sweep was not started: {len(problems)} problem(s) in its {len(jobs)} jobs",
                file=sys.stderr,
            )
            for line in problems:
                print(f"  {redact_text(line)}", file=sys.stderr)  # a composition error may quote a value
            sys.exit(2)
        print(f"ds_exp: all {len(jobs)} jobs of the sweep are valid")


class SweepReport(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from ds_exp.report import write_report

        if config.get("dry_run"):
            return  # planned, not run: nothing to report
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_report(sweep_dir)
        from ds_exp.autotune import PLAN_FILE

        if (sweep_dir / PLAN_FILE).is_file():  # probes that fail are results of the autotune sweep, not errors
            if not any(row["status"] == "completed" for row in rows):
                print("ds_exp: error: autotune: no probe completed; nothing to recommend", file=sys.stderr)
                sys.exit(1)
            return
        failed = [row for row in rows if row["status"] != "completed"]
        if failed:
            print(f"ds_exp: error: {len(failed)} of {len(rows)} sweep jobs did not complete", file=sys.stderr)
            sys.exit(1)
