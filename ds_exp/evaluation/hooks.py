"""The run's lm-eval scores: after the run, and with eval.harness.every_save after each step export. A failure never
fails the completed run (summary.json's `harness_status`; `python -m ds_exp.evaluate` scores it later)."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

from ds_exp.artifacts.tracking import MetricsLog, Trackers
from ds_exp.config.paths import data_cache_dir
from ds_exp.core.errors import DsExpError, first_line
from ds_exp.evaluation.checks import Scoring, resolve_tasks
from ds_exp.evaluation.report import few_questions, flat, table, tracker_metrics
from ds_exp.exports.on_disk import read_metadata
from ds_exp.launch.run_logging import FILE_LOGGER
from ds_exp.runtime.signals import StopRequested
from ds_exp.train.hooks import FeatureHooks, Run
from ds_exp.train.session import Session

log = logging.getLogger("ds_exp.train")
file_log = logging.getLogger(FILE_LOGGER)

EVAL_DIR = "eval"


class HarnessHooks(FeatureHooks):
    settings: Scoring

    @property
    def merged_exports(self) -> bool:
        return self.settings.harness.every_save  # the step exports' merged model is what every_save scores

    def after_run(self, run: Run) -> None:
        """Rank 0 scores the run's final export (and its base); every failure is the evaluation's own status."""
        session, harness = run.session, self.settings.harness
        export_dir = session.state.export_dir
        if not session.is_main or export_dir is None:
            return
        state, step = session.state, int(session.state.steps or 0)
        record = self._scored(session, Path(export_dir), session.run_dir / EVAL_DIR, base=harness.base)
        if isinstance(record, str):
            state.harness_status, state.harness_error = record.split(":", 1)[0], record.split(": ", 1)[1]
            return
        state.harness, state.harness_status = flat(record, "tuned"), "completed"
        state.harness_base = flat(record, "base") or None
        _log(session, record, step)
        base_scored = record["settings"].get("base_scored")
        cached = "" if not harness.base or base_scored else " (the base model's scores from the cache)"
        log.info("lm-eval scores of %s%s:\n%s", export_dir, cached, table(record))
        for line in few_questions(record, "eval.harness.limit"):
            log.warning("%s", line)

    def after_export(self, run: Run, export: Path, step: int, *, final: bool) -> None:
        """eval.harness.every_save: rank 0 scores a step export alone into RUN_DIR/eval/<export>/."""
        session = run.session
        if final or not (self.settings.harness.every_save and session.is_main):
            return
        record = self._scored(session, export, session.run_dir / EVAL_DIR / export.name, base=False)
        if isinstance(record, str):
            log.warning("lm-eval scores of %s: %s; training goes on", export, record)
            return
        _log(session, record, step)

    def _scored(self, session: Session, export_dir: Path, out_dir: Path, *, base: bool) -> dict[str, Any] | str:
        """harness.json's record, or "failed: why" / "interrupted: why"."""
        from ds_exp.evaluation.harness import builtin_of, evaluate, settings_of  # lm-eval: an optional extra

        gc.collect()  # what training held (the engine is released) before lm-eval loads the export
        cfg, harness = session.cfg, self.settings.harness  # the run's: its sampling, data cache and base model
        accelerator = session.accelerator
        device = "cpu" if accelerator == "cpu" else f"{accelerator}:{session.launch.local_rank}"
        if harness.device != "auto":
            device = harness.device
        template = (read_metadata(export_dir).get("generation") or {}).get("template")
        session.signals.immediate = True  # a stop signal or Ctrl-C ends the evaluation at once: the run is complete
        try:
            specs, problems = resolve_tasks(harness.tasks, self.settings.lengths, key="eval.harness.tasks")
            if problems:  # checked before the run; a file changed since
                return f"failed: {problems[0]}"
            evaluation = evaluate(
                export_dir,
                specs,
                settings_of(harness, cfg.eval, template, device),
                out_dir=out_dir,
                cache_dir=data_cache_dir(cfg.data.cache_dir),
                builtin=builtin_of(cfg.data, harness),
                base_cfg=cfg if base else None,
                title=f"{session.run_dir.name}: {export_dir.name}",
            )
        except (Exception, KeyboardInterrupt) as err:
            interrupted = isinstance(err, (KeyboardInterrupt, StopRequested))
            said = first_line(err) if isinstance(err, DsExpError) else f"{type(err).__name__}: {first_line(err)}"
            why = f"{'interrupted' if interrupted else 'failed'}: {said}"
            file_log.error("lm-eval scores of %s %s", export_dir, why, exc_info=err)
            log.error(
                "lm-eval scores of %s %s; the run itself is unaffected: python -m ds_exp.evaluate %s %s scores it",
                export_dir,
                why,
                session.run_dir,
                " ".join(harness.tasks),
            )
            return why
        finally:
            session.signals.immediate = False
        return evaluation.record


def _log(session: Session, record: dict[str, Any], step: int) -> None:
    metrics = tracker_metrics(record)
    for sink in session.sinks:
        if isinstance(sink, Trackers):
            sink.log(metrics, step)
        elif isinstance(sink, MetricsLog):
            sink.write({"type": "harness", "step": step, **metrics})
