"""One trajectory per run directory: a save over another branch's checkpoint, what rotation may delete, and the branch
an older resume abandons, set aside (never deleted) with its exports. File operations only (rank 0)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_exp.config.command_line import override
from ds_exp.core.files import write_text_atomic
from ds_exp.resume.store import (
    BRANCHES,
    COMPLETE_MARKER,
    LATEST,
    TrainState,
    _step_of,
    complete_checkpoints,
    is_complete,
    read_marker,
    step_dirs,
)

log = logging.getLogger(__name__)

BRANCH_EXPORTS = "exports"  # branches/<branch>/exports/: the Hugging Face exports made on an abandoned branch


def save_verdict(checkpoint_dir: Path, path: Path, state: TrainState) -> str | None:
    """Rank 0, before a save at `path`: "same" (these weights are there), a refusal (another run's), or None to save."""
    if not (path / COMPLETE_MARKER).is_file():
        return None
    marker = read_marker(path)
    if state.branch is not None and marker.get("branch") == state.branch:
        log.info("checkpoint %s is complete already; not saved again", path)
        return "same"
    run_dir = Path(state.run_dir) if state.run_dir else None
    if run_dir is not None and belongs_to(path, run_dir, marker):
        later = [c for c in step_dirs(checkpoint_dir) if _step_of(c) >= _step_of(path)]
        branch = move_branch(checkpoint_dir, later, _step_of(path) - 1)
        log.warning(
            "%s held a checkpoint of another branch of this run: moved (not deleted) into %s; continue it with "
            "resume=%s",
            path,
            branch,
            branch / path.name,
        )
        return None
    return (
        f"{path} is a complete checkpoint of another run, so it is not overwritten; point train.checkpoint_dir "
        "at a directory of this run's own"
    )


def rotated(checkpoint_dir: Path, state: TrainState, keep_last: int) -> list[Path]:
    """The checkpoints rotation deletes after a save: this run's complete older ones but the newest keep_last - 1."""
    if keep_last <= 0:
        return []
    older = [
        c
        for c in complete_checkpoints(checkpoint_dir)
        if _step_of(c) < state.step and read_marker(c).get("run_id") == state.run_id
    ]
    return older[: max(len(older) - (keep_last - 1), 0)]


def belongs_to(tag_dir: Path, run_dir: Path, marker: dict[str, Any] | None = None) -> bool:
    """Whether `run_dir` wrote `tag_dir`: all inside a run directory is its own; outside it, the marker says."""
    run_dir = run_dir.resolve()
    if tag_dir.resolve().is_relative_to(run_dir):
        return True
    marker = read_marker(tag_dir) if marker is None else marker
    return marker.get("run_dir") == str(run_dir)


def is_same_run(tag_dir: Path, run_dir: Path, checkpoint_dir: Path) -> bool:
    """Whether a resume from `tag_dir` continues the run of `run_dir` (else it starts a run of its own)."""
    written_by = read_marker(tag_dir).get("run_dir")
    here = tag_dir.parent.resolve() == checkpoint_dir.resolve()
    return here and (written_by is None or written_by == str(run_dir.resolve()))


@dataclass(frozen=True)
class SetAside:
    """What a resume set aside as an abandoned branch (set_aside_branch)."""

    branch: Path | None  # branches/<time>-resumed-at-step<N>/; None when nothing was off the trajectory
    checkpoints: list[str]  # the complete checkpoints moved there
    exports: list[str] = field(default_factory=list)  # the branch's exports moved into its exports/ folder
    exports_left: list[Path] = field(default_factory=list)  # those that could not move (another file system)

    def message(self, resumed_from: Path, run_dir: Path, here: bool) -> str:
        """What the resume says: why there is a branch, what moved where, what could not, how to go back to it."""
        why = (
            f"{resumed_from.name} is older than this directory's newest checkpoint, so the later ones are an "
            "abandoned branch of the run"
            if here
            else f"{resumed_from} is another directory's checkpoint, so this directory's own form another trajectory"
        )
        text = f"{why}: {', '.join([*self.checkpoints, *self.exports])} moved (nothing deleted) into {self.branch}"
        if self.exports_left:
            text += (
                f"; its exports {', '.join(str(p) for p in self.exports_left)} are on another file system and stay "
                "where they are: move them away before this trajectory exports the same steps over them"
            )
        if self.branch is not None and self.checkpoints:
            text += (
                f"; to go back to it: {override('resume', self.branch / self.checkpoints[-1])} "
                f"{override('hydra.run.dir', run_dir)} (this "
                "trajectory's checkpoints are then set aside in turn); python -m ds_exp.export exports any of them"
            )
        return text


def set_aside_branch(checkpoint_dir: Path, resumed_from: Path, run_dir: Path, exports: Sequence[Path] = ()) -> SetAside:
    """Rank 0, once a resume is loaded: this run directory's checkpoints off the resumed trajectory (with their
    conversions and exports) move to branches/<time>-resumed-at-step<N>/; `latest` then points at the newest complete
    checkpoint left (removed if none)."""
    step = _step_of(resumed_from)
    here = resumed_from.parent.resolve() == checkpoint_dir.resolve()
    off_trajectory = [c for c in step_dirs(checkpoint_dir) if not (here and _step_of(c) <= step)]
    complete = [c for c in off_trajectory if is_complete(c) and belongs_to(c, run_dir)]
    moved: Path | None = None
    if complete:
        inside = checkpoint_dir.resolve().is_relative_to(run_dir.resolve())
        incomplete = [c for c in off_trajectory if not is_complete(c) and inside and _step_of(c) > step]
        moved = move_branch(checkpoint_dir, sorted([*complete, *incomplete], key=_step_of), step)
    _repair_latest(checkpoint_dir)
    done, left = _move_exports(exports, moved / BRANCH_EXPORTS) if moved is not None else ([], [])
    return SetAside(moved, [c.name for c in complete], done, left)


def _move_exports(exports: Sequence[Path], target: Path) -> tuple[list[str], list[Path]]:
    """Rename each export into `target` (nothing copied or deleted); one on another file system stays where it is."""
    done: list[str] = []
    left: list[Path] = []
    for export in exports:
        try:
            target.mkdir(exist_ok=True)
            os.replace(export, target / export.name)
            done.append(export.name)
        except OSError as err:
            log.debug("could not move %s into %s: %s", export, target, err)
            left.append(export)
    return done, left


def move_branch(checkpoint_dir: Path, tag_dirs: list[Path], step: int) -> Path:
    """Move `tag_dirs` and their conversions into a new branches/<time>-resumed-at-step<step>/ (renames only)."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    target = checkpoint_dir / BRANCHES / f"{stamp}-resumed-at-step{step}"
    n = 1
    while target.exists():
        n += 1
        target = checkpoint_dir / BRANCHES / f"{stamp}-resumed-at-step{step}-{n}"
    target.mkdir(parents=True)
    for tag_dir in tag_dirs:
        os.replace(tag_dir, target / tag_dir.name)
        conversion = tag_dir.parent / f"{tag_dir.name}.universal"
        if conversion.is_dir():
            os.replace(conversion, target / conversion.name)
    _repair_latest(checkpoint_dir)
    return target


def _repair_latest(checkpoint_dir: Path) -> None:
    """`latest` names an existing complete checkpoint, or is absent."""
    pointer = checkpoint_dir / LATEST
    if not pointer.is_file():
        return
    try:
        named = pointer.read_text().strip()
    except OSError:
        named = ""
    if named and is_complete(checkpoint_dir / named):
        return
    found = complete_checkpoints(checkpoint_dir)
    if found:
        write_text_atomic(pointer, found[-1].name)
    else:
        pointer.unlink(missing_ok=True)
