"""The run's exports at the recipe's named points (ds_exp/train/hooks.py; the package docstring lists them)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from ds_exp.config.schema import plain
from ds_exp.data.templates import first_template
from ds_exp.exports.checks import check_target
from ds_exp.exports.feature import RunExportSettings
from ds_exp.exports.on_disk import (
    WRITTEN_BY_RUN,
    adapter_dir,
    exports_off_trajectory,
    one_export_bytes,
    planned_step_exports,
    rotated_step_exports,
    step_export_dir,
)
from ds_exp.exports.writer import export_hf, export_spec
from ds_exp.train.generate import stop_token_ids
from ds_exp.train.hooks import FeatureHooks, Run

log = logging.getLogger("ds_exp.train")


class ExportHooks(FeatureHooks):
    """Collective: every rank calls each point (ZeRO-3 gathers the weights with all of them); rank 0 writes."""

    settings: RunExportSettings

    def planned_writes(
        self, run: Run, start_step: int, total_steps: int, parameters: int, trainable: int
    ) -> dict[Path, tuple[int, str]]:
        """The final and step exports at their most; a target not an earlier export is refused now."""
        export, lora, session = self.settings.export, self.settings.lora.dim, run.session
        planned = planned_step_exports(export, session.run_dir, start_step, total_steps)
        for path in planned:
            check_target(path, key="train.export_every", fix="move it away, or set train.export_every=0")
        needs: dict[Path, tuple[int, str]] = {}
        if export.export:
            check_target(self.export_dir(run))
            size = one_export_bytes(export, lora, parameters, trainable, session.precision, final=True)
            needs[self.export_dir(run)] = (size, "train.export_dir")
        if planned:
            each = one_export_bytes(export, lora, parameters, trainable, session.precision, final=False)
            keep = export.export_keep_last
            needs[planned[0]] = (each * (min(keep + 1, len(planned)) if keep else len(planned)), "train.export_every")
        return needs

    def on_branch(self, run: Run, step: int, *, same_directory: bool) -> list[Path]:
        return exports_off_trajectory(self.export_dir(run), run.session.run_dir, step, same_directory=same_directory)

    def export_dir(self, run: Run) -> Path:
        return run.session.run_dir / self.settings.export.export_dir

    def after_step(self, run: Run, step: int) -> None:
        """The step export (train.export_every), then this run's older ones beyond train.export_keep_last."""
        export, session = self.settings.export, run.session
        assert run.work is not None
        if not export.export_every or step % export.export_every or step >= run.work.total_steps:
            return  # the last step has the final export
        if run.metrics is not None:
            run.metrics.write()  # the step's line first: the export takes a while
        merged = export.merges(self.settings.lora.dim, final=False) or run.hooks.merged_exports
        written = self._export(run, step_export_dir(self.export_dir(run), step), step, merged=merged)
        if session.is_main:
            log.info("exported step %d to %s", step, written)
        run.hooks.after_export(run, written, step, final=False)  # before rotation
        if session.is_main:
            for old in rotated_step_exports(self.export_dir(run), run.run_id, export.export_keep_last):
                shutil.rmtree(old, ignore_errors=True)

    def after_train(self, run: Run) -> None:
        """The final export (train.export)."""
        state = run.session.state
        if self.settings.export.export:
            assert state.steps is not None  # set once training ends
            merged = self.settings.export.merges(self.settings.lora.dim, final=True)
            written = self._export(run, self.export_dir(run), state.steps, merged=merged)
            state.export_dir = str(written)
            run.hooks.after_export(run, written, state.steps, final=True)

    def _export(self, run: Run, target: Path, step: int, *, merged: bool) -> Path:
        """Collective: `target` written (with LoRA the adapter beside; merged with `merged`); the model's dir."""
        work, session, settings = run.work, run.session, self.settings
        assert work is not None
        spec = export_spec(
            settings.model,
            work.built,
            session.precision,
            dtype=str(plain(settings.export.export_dtype)),
            template=first_template(work.data.stats),
            stop_token_ids=tuple(stop_token_ids(work.tokenizer, settings.end_of_conversation_token)),
            origin={"written_by": WRITTEN_BY_RUN, "run_id": run.run_id, "step": step, "run_dir": str(session.run_dir)},
        )
        export_hf(
            work.engine,
            zero_stage=work.zero_stage,
            spec=spec,
            tokenizer=work.tokenizer,
            export_dir=target,
            save_adapter=True,
            merged=merged,
        )
        return target if merged else adapter_dir(target)
