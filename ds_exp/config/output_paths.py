"""train.checkpoint_dir and train.export_dir, checked with the rest of the config."""

from __future__ import annotations

import os
from pathlib import Path

from ds_exp.config.schema import TrainConfig

NAME_MAX = 255  # bytes per file name on Linux file systems (ext4, xfs, tmpfs, NFS)


def output_path_problems(train: TrainConfig, run_dir: Path | None = None) -> list[str]:
    """Checkpoints and the export stay inside the run directory, are not it, and neither holds the other."""
    problems = []
    for key in ("checkpoint_dir", "export_dir"):
        value = str(getattr(train, key))
        path = Path(value).expanduser()
        # a name too long for any file system: shapes.path_too_long, which runs first
        if not train.allow_outside_run_dir and (not value or path.is_absolute() or ".." in path.parts):
            problems.append(
                f"train.{key}={value}: must be a directory inside the run directory (relative, no '..'), so that "
                f"no run writes into or deletes from another's; set train.allow_outside_run_dir=true to allow it"
            )
    if problems:
        return problems
    base = run_dir.absolute() if run_dir is not None else Path("/<run dir>")  # relative paths compare alike
    paths = {
        key: Path(os.path.normpath(base / Path(str(getattr(train, key))).expanduser()))
        for key in ("checkpoint_dir", "export_dir")
    }
    shown = {key: f"train.{key}={getattr(train, key)}" for key in paths}
    if run_dir is None and len({Path(str(getattr(train, k))).expanduser().is_absolute() for k in paths}) > 1:
        return []  # one absolute, one relative: compared once the run directory is known
    for key, path in paths.items():
        if path == base:
            problems.append(
                f"{shown[key]} is the run directory itself: give it a directory of its own inside the run directory "
                f"(the default is {'checkpoints' if key == 'checkpoint_dir' else 'hf_model'})"
            )
        elif run_dir is not None and base.is_relative_to(path):
            problems.append(
                f"{shown[key]} holds the run directory {base}: give it a directory of its own, not one of the run "
                "directory's parents"
            )
    if problems:
        return problems
    ckpt, export = paths["checkpoint_dir"], paths["export_dir"]
    if ckpt == export:
        return [
            f"{shown['checkpoint_dir']} and train.export_dir are the same directory: the export would replace the "
            "checkpoints; give each its own (the defaults are checkpoints and hf_model)"
        ]
    if ckpt.is_relative_to(export):
        return [
            f"{shown['checkpoint_dir']} is inside {shown['export_dir']}: the export replaces that directory, so it "
            "would fail after training (and on every resume); put the checkpoints beside it (e.g. "
            "train.checkpoint_dir=checkpoints)"
        ]
    if export.is_relative_to(ckpt):
        return [
            f"{shown['export_dir']} is inside {shown['checkpoint_dir']}: checkpoints and their rotation own that "
            "directory; put the export beside it (e.g. train.export_dir=hf_model)"
        ]
    return []
