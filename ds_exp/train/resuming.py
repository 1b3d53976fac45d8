"""Where a run starts: the checkpoint it continues, decided before the engine (`resume_plan`), then loaded and placed on
the run's trajectory (`resume`), or step 0. What may change across a resume is ds_exp.resume's rule."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

from ds_exp.checkpoint.checkpointer import load_checkpoint
from ds_exp.checkpoint.universal import load_state
from ds_exp.config.optimizer_settings import OptimizerConfig
from ds_exp.config.schema import TrainConfig
from ds_exp.launch.run_dir import completed_at, set_aside_attempt
from ds_exp.model.engine import lr_at, parameter_groups
from ds_exp.resume import trajectory
from ds_exp.resume.branches import is_same_run, set_aside_branch
from ds_exp.resume.settings import check_resume, layout_changes, needs_universal, sequence_parallel_change
from ds_exp.resume.store import TrainState, find_resume_checkpoint, read_marker, resume_wanted
from ds_exp.runtime.process_group import broadcast
from ds_exp.train.hooks import Run, RunHooks
from ds_exp.train.session import NothingToDo, Session
from ds_exp.train.workload import Workload

log = logging.getLogger("ds_exp.train")


def resume_plan(
    resume: str | None, train: TrainConfig, session: Session, settings: dict[str, Any]
) -> tuple[Path | None, bool]:
    """The checkpoint to continue from (None: fresh), and whether it loads through DeepSpeed's universal format."""
    wanted = resume_wanted(resume, session.launch.launcher)
    tag_dir = find_resume_checkpoint(wanted, session.run_dir, train.checkpoint_dir)
    if tag_dir is None:
        return None, False
    check_resume(resume, tag_dir, settings)  # also where Hydra's callback did not run (submitit)
    saved = read_marker(tag_dir).get("settings") or {}
    if session.is_main:
        for line in layout_changes(saved, settings):
            log.warning("resume: %s", line)
        sp_line = sequence_parallel_change(saved, settings)
        if sp_line is not None:
            log.warning("resume: %s", sp_line)
    session.resume_source = tag_dir.absolute()  # what a stop before this attempt's first checkpoint names to continue
    return tag_dir, needs_universal(saved, settings)


def resume(
    wanted: str | None, train: TrainConfig, opt: OptimizerConfig, session: Session, work: Workload, hooks: RunHooks
) -> TrainState:
    """The state to start from: a checkpoint's (`wanted`: resume=auto / <path>), or step 0."""
    run_dir, tag_dir = session.run_dir, work.resume_from
    if tag_dir is None:
        if resume_wanted(wanted, session.launch.launcher) is not None and session.is_main:
            moved = set_aside_attempt(run_dir)  # an attempt that left no checkpoint: start over beside it
            if moved is not None:
                log.warning("no complete checkpoint to resume from: starting over; the earlier attempt is in %s", moved)
            else:  # said, so that a resume that finds nothing never looks like one that did
                log.info("resume=auto: no complete checkpoint in %s: a fresh start", run_dir / train.checkpoint_dir)
        run_id, branch = broadcast((_new_run_id(), _new_run_id()))
        return TrainState(run_id=run_id, branch=branch, run_dir=str(run_dir.resolve()))
    if work.universal:
        state = TrainState(**_load_universal(train.seed, opt, session, work, tag_dir))
    else:
        state = load_checkpoint(work.engine, tag_dir, rank=session.rank)
    for change in trajectory.check(wanted, state.trajectory, work.trajectory, state.step, tag_dir, lr_at):
        if session.is_main:
            log.warning("resume: %s", change)
    session.state.resumed_from, session.state.initial_eval = str(tag_dir), state.initial_eval
    session.state.start_step = state.step
    if state.step >= work.total_steps:
        # a checkpoint at the last step is not a finished run: one killed just after saving it, or resumed with
        # a train.max_steps lowered to it, still owes its final evaluation, export and summary
        if broadcast(completed_at(run_dir) if session.is_main else None) == state.step:
            raise NothingToDo(f"{run_dir} is complete at step {state.step} of {work.total_steps}")
        if session.is_main:
            log.warning(
                "resume: the checkpoint at step %d is at or past the last step (%d) but the run never finished: "
                "finishing it without training (final evaluation, export, summary)",
                state.step,
                work.total_steps,
            )
    return continue_trajectory(train, session, state, tag_dir, hooks)


def continue_trajectory(
    train: TrainConfig, session: Session, state: TrainState, tag_dir: Path, hooks: RunHooks
) -> TrainState:
    """Collective, once the resume is accepted: checkpoints off the trajectory set aside as a branch."""
    run_dir, checkpoint_dir = session.run_dir, session.run_dir / train.checkpoint_dir
    decided = None
    if session.is_main:
        here = tag_dir.parent.resolve() == checkpoint_dir.resolve()
        made_on_it = hooks.on_branch(Run(session, hooks), state.step, same_directory=here)
        aside = set_aside_branch(checkpoint_dir, tag_dir, run_dir, made_on_it)
        if aside.branch is not None:
            log.warning("resume: %s", aside.message(tag_dir, run_dir, here))
        same_run = state.run_id is not None and is_same_run(tag_dir, run_dir, checkpoint_dir)
        decided = (state.run_id if same_run else _new_run_id(), _new_run_id())
    run_id, branch = broadcast(decided)
    return TrainState(**{**state.as_dict(), "run_id": run_id, "branch": branch, "run_dir": str(run_dir.resolve())})


def _load_universal(seed: int, opt: OptimizerConfig, session: Session, work: Workload, tag_dir: Path) -> dict[str, Any]:
    model = work.built.model
    return load_state(
        work.engine,
        tag_dir,
        rank=session.rank,
        world_size=session.world,
        seed=seed,
        model=model,
        groups=parameter_groups(model, opt.weight_decay, list(opt.no_decay)),
    )


def _new_run_id() -> str:
    return uuid.uuid4().hex
