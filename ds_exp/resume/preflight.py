"""Before Hydra writes into a run directory: the checkpoint `resume` names can be loaded by this run."""

from __future__ import annotations

from pathlib import Path

from ds_exp.config.batch import data_parallel_size, global_batch_size
from ds_exp.config.ds_config import merged_ds_config
from ds_exp.config.precision import decide_precision, detect_accelerator, supports_bf16
from ds_exp.config.schema import Config
from ds_exp.resume.settings import check_resume, settings_of
from ds_exp.resume.store import find_resume_checkpoint, read_marker
from ds_exp.resume.trajectory import check


def check_resume_target(cfg: Config, run_dir: Path, world: int) -> None:
    """The checkpoint `resume` names exists, is complete and was written with this run's settings (`world`: the
    world size this launch has)."""
    tag_dir = find_resume_checkpoint(cfg.resume, run_dir, cfg.train.checkpoint_dir)
    if tag_dir is None:
        return
    accelerator = detect_accelerator()
    precision = decide_precision(cfg.precision.dtype, accelerator, supports_bf16(accelerator))
    check_resume(cfg, tag_dir, settings_of(cfg, world, merged_ds_config(cfg), precision))
    check_global_batch(cfg, tag_dir, world)


def check_global_batch(cfg: Config, tag_dir: Path, world: int) -> None:
    """The one trajectory refusal that needs nothing heavy to decide (ds_exp.resume.trajectory has the rest)."""
    saved = read_marker(tag_dir).get("trajectory")
    if saved:
        train = cfg.train
        batch = global_batch_size(train, data_parallel_size(world, int(cfg.dist.sequence_parallel_size)))
        check(cfg, {"global_batch": saved.get("global_batch")}, {"global_batch": batch, "data": None}, 0, tag_dir)
