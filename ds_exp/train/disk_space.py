"""Before training: what the run will write fits on its disk, checked by rank 0 and obeyed by every rank."""

from __future__ import annotations

from pathlib import Path

from ds_exp.config.schema import TrainConfig
from ds_exp.core.errors import RunFailed
from ds_exp.launch.run_dir import completed_at
from ds_exp.launch.storage import check_free_space
from ds_exp.runtime.process_group import broadcast
from ds_exp.train.hooks import Run, RunHooks
from ds_exp.train.session import Session


def saves_a_checkpoint(train_cfg: TrainConfig, start_step: int, total_steps: int) -> bool:
    """Whether a run from `start_step` to `total_steps` writes a checkpoint (the final one, or a save_every one)."""
    if start_step >= total_steps:
        return False
    every = train_cfg.save_every
    return bool(train_cfg.save_final_checkpoint) or (bool(every) and total_steps // every * every > start_step)


def check_disk_space(
    train_cfg: TrainConfig,
    hooks: RunHooks,
    session: Session,
    checkpoint_size: int,
    parameters: int,
    *,
    trainable: int | None = None,
    start_step: int = 0,
    total_steps: int = 0,
) -> None:
    """Collective: rank 0 checks that a checkpoint and the planned writes fit on its disk; every rank obeys."""
    trainable = parameters if trainable is None else trainable
    verdict = None
    finished = start_step > 0 and start_step >= total_steps and completed_at(session.run_dir) == start_step
    if session.is_main and not finished:
        needs: dict[Path, int] = {}
        keys: dict[Path, str] = {}
        if saves_a_checkpoint(train_cfg, start_step, total_steps):
            path = session.run_dir / train_cfg.checkpoint_dir
            needs[path], keys[path] = checkpoint_size, "train.checkpoint_dir"
        try:
            planned = hooks.planned_writes(Run(session, hooks), start_step, total_steps, parameters, trainable)
            for path, (size, key) in planned.items():
                needs[path], keys[path] = size, key
            check_free_space(needs, keys)
        except RunFailed as err:
            verdict = str(err)
    verdict = broadcast(verdict)
    if verdict is not None:
        raise RunFailed(verdict)
