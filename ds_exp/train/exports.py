"""The run's Hugging Face exports: the final one (train.export_dir), and with train.export_every one every N steps
during training (<export_dir>-step<N>, beside it; the last step has the final one), of which the newest
train.export_keep_last of this run are kept. Each is made by ds_exp/artifacts/export.py and records the run, its step,
and how the run asked the model (template, stop tokens) for `python -m ds_exp.chat`. With LoRA each export is the
adapter (<export_dir>[-step<N>]_adapter, a few MB), and the merged model where train.export_merged asks for it: by
default in the final export only.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from ds_exp.artifacts.export import check_target, export_hf, export_spec
from ds_exp.config.export_schema import merges
from ds_exp.config.schema import Config
from ds_exp.data.templates import first_template
from ds_exp.launch.exports import WRITTEN_BY_RUN, adapter_dir, rotated_step_exports, step_export_dir
from ds_exp.train.generate import stop_token_ids
from ds_exp.train.hooks import Run, RunHooks
from ds_exp.train.session import Session
from ds_exp.train.workload import Workload

log = logging.getLogger("ds_exp.train")


def planned_step_exports(cfg: Config, run_dir: Path, start_step: int, total_steps: int) -> list[Path]:
    """The step exports a run from `start_step` to `total_steps` will write (the last step has the final export)."""
    every = cfg.train.export_every
    if not every:
        return []
    export_dir = run_dir / cfg.train.export_dir
    return [step_export_dir(export_dir, s) for s in range((start_step // every + 1) * every, total_steps, every)]


def step_export_needs(cfg: Config, planned: list[Path], per_export: int) -> int:
    """Disk for the step exports at their most: train.export_keep_last of them, plus the one being written."""
    keep = cfg.train.export_keep_last
    return per_export * (min(keep + 1, len(planned)) if keep else len(planned))


def check_step_export_targets(planned: list[Path]) -> None:
    """Before training: a step export would replace nothing that is not an export (checked again when written)."""
    for path in planned:
        check_target(path, key="train.export_every", fix="move it away, or set train.export_every=0")


class RunExports:
    """Collective: every rank calls each method (ZeRO-3 gathers the weights with all of them); rank 0 writes."""

    def __init__(self, cfg: Config, session: Session, work: Workload, run_id: str | None, hooks: RunHooks) -> None:
        self.cfg, self.session, self.work, self.run_id, self.hooks = cfg, session, work, run_id, hooks
        self.export_dir = session.run_dir / cfg.train.export_dir

    def final(self) -> None:
        if self.cfg.train.export:
            steps = self.session.state.steps
            assert steps is not None  # set once training ends
            merged = merges(self.cfg.train.export_merged, self.cfg.lora.dim, final=True)
            self._export(self.export_dir, steps, merged=merged)
            written = self.export_dir if merged else adapter_dir(self.export_dir)
            self.session.state.export_dir = str(written)
            self.hooks.after_export(Run(self.session, self.work), written, steps, final=True)

    def at_step(self, step: int) -> None:
        """The step export (train.export_every), then this run's older ones beyond train.export_keep_last."""
        target = step_export_dir(self.export_dir, step)
        # a feature that reads each step's merged model (eval.harness.every_save) has it whatever export_merged says
        merged = merges(self.cfg.train.export_merged, self.cfg.lora.dim, final=False) or self.hooks.merged_exports
        self._export(target, step, merged=merged)
        written = target if merged else adapter_dir(target)
        if self.session.is_main:
            log.info("exported step %d to %s", step, written)
        self.hooks.after_export(Run(self.session, self.work), written, step, final=False)  # before rotation
        if self.session.is_main:
            for old in rotated_step_exports(self.export_dir, self.run_id, self.cfg.train.export_keep_last):
                shutil.rmtree(old, ignore_errors=True)

    def _export(self, target: Path, step: int, *, merged: bool) -> None:
        cfg, work = self.cfg, self.work
        spec = export_spec(
            cfg,
            work.built,
            self.session.precision,
            template=first_template(work.data.stats),
            stop_token_ids=tuple(stop_token_ids(work.tokenizer, cfg.data.end_of_conversation_token)),
            origin={
                "written_by": WRITTEN_BY_RUN,
                "run_id": self.run_id,
                "step": step,
                "run_dir": str(self.session.run_dir),
            },
        )
        export_hf(
            work.engine,
            zero_stage=work.zero_stage,
            spec=spec,
            tokenizer=work.tokenizer,
            export_dir=target,
            save_adapter=True,  # with LoRA the adapter, always: it is small
            merged=merged,
        )
