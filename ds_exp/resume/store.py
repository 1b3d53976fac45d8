"""A run directory's checkpoints on disk: tags, completeness markers, `latest`, and which one a
resume continues from. Light: no torch, no deepspeed."""

from __future__ import annotations

import re
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

from ds_exp.core.errors import ResumeError, first_line
from ds_exp.core.files import read_json_object, restore_non_finite

COMPLETE_MARKER = "ds_exp_complete.json"
LATEST = "latest"  # DeepSpeed's name for the file that holds the newest tag


_TAG = re.compile(r"^step(\d+)$")


@dataclass(frozen=True)
class TrainState:
    """Where training stands: enough to continue exactly as if it had never stopped."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch
    step_in_epoch: int = 0  # optimizer steps done within `epoch`
    # each tracker's run id by its table's run_id_key (ds_exp.config.trackers): a resume continues the same runs
    trackers: dict[str, str] = field(default_factory=dict)
    # the loss sums of the metric window open at a stop signal, so the resumed run's next metric line covers the
    # same steps as an uninterrupted run's
    window_loss_sum: float = 0.0
    window_label_tokens: float = 0.0
    window_sums: list[float] = field(default_factory=list)  # the objective's more sums (ds_exp.train.step.Objective)
    initial_eval: dict[str, float] | None = None  # the run's first evaluation, for its summary after a resume
    # what the run's course depends on (ds_exp.resume.trajectory): a resume says what changed, or refuses
    trajectory: dict[str, Any] | None = None
    # the run that wrote the checkpoint: rotation only ever deletes this run's checkpoints
    run_id: str | None = None
    # a new id each time a process starts training: a checkpoint at the same step holds the same weights only when
    # its branch is this one
    branch: str | None = None
    run_dir: str | None = None  # the run directory that wrote it (a checkpoint directory may be shared)
    # what the checkpoint depends on (ds_exp.resume.settings_of): a resume with other values is refused
    settings: dict[str, Any] | None = None
    # the `model` section that trained the weights (a resume may change it): its export rebuilds the model with it
    model_config: dict[str, Any] | None = None
    # the frozen weights (LoRA's base) the checkpoint leaves out, as built (ds_exp.checkpoint.frozen): a resume or an
    # export continues only on the same ones; None when the checkpoint holds every weight
    base: dict[str, Any] | None = None
    # older markers held one field per tracker: read into `trackers`, never written again
    wandb_run_id: InitVar[str | None] = None
    mlflow_run_id: InitVar[str | None] = None

    def __post_init__(self, wandb_run_id: str | None, mlflow_run_id: str | None) -> None:
        earlier = {"wandb": wandb_run_id, "mlflow": mlflow_run_id}
        ids = {**{key: run_id for key, run_id in earlier.items() if run_id}, **self.trackers}
        object.__setattr__(self, "trackers", ids)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def tag_for(step: int) -> str:
    return f"step{step}"


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    return [tag_dir for tag_dir in step_dirs(checkpoint_dir) if is_complete(tag_dir)]


def is_complete(tag_dir: Path) -> bool:
    """Complete only when its marker is the JSON object ds_exp writes last; anything else counts as missing."""
    return bool(read_marker(tag_dir))


def read_marker(tag_dir: Path) -> dict[str, Any]:
    """The completeness marker of a checkpoint (its TrainState); {} when missing, unreadable or not an object."""
    marker = read_json_object(tag_dir / COMPLETE_MARKER) or {}
    return restore_non_finite(marker) if "step" in marker else {}


def resume_wanted(resume: str | None, launcher: str) -> str | None:
    """What a run continues from: `resume` as given, but auto for a submitit job without one (SLURM requeues it)."""
    if resume is None and launcher == "submitit":
        return "auto"
    return resume


def find_resume_checkpoint(resume: str | None, run_dir: Path, checkpoint_subdir: str) -> Path | None:
    """The checkpoint tag directory to resume from; None to start fresh (resume=null, or auto with none yet)."""
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir / checkpoint_subdir)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if is_complete(path):
        return path
    if _TAG.match(path.name) and path.is_dir():  # one checkpoint, named as such: never a half-written one
        raise ResumeError(
            f"resume={resume}: {not_complete(path)}, so it is not resumed from; give a complete one, or its run "
            "directory (resume=<run dir> continues from the newest complete checkpoint there)"
        )
    for candidate in (path, path / checkpoint_subdir):
        found = complete_checkpoints(candidate)
        if found:
            return found[-1]
    raise ResumeError(
        f"resume={resume}: no complete checkpoint in {path} (looked for step<N>/{COMPLETE_MARKER} there and "
        f"under {checkpoint_subdir}/); give a run directory, its checkpoints directory or one step<N> directory"
    )


def damaged_message(tag_dir: Path, err: BaseException) -> str:
    """A checkpoint marked complete that cannot be read (a file truncated or deleted since): name the fallback."""
    first = first_line(err)
    earlier = [c for c in complete_checkpoints(tag_dir.parent) if _step_of(c) < _step_of(tag_dir)]
    fallback = (
        f"the previous complete checkpoint is {earlier[-1]}: continue from it with resume={earlier[-1]}"
        if earlier
        else "there is no earlier complete checkpoint: start over without resume"
    )
    return f"resume: {tag_dir} cannot be read, a file of it is damaged or missing ({first}); {fallback}"


def _step_of(tag_dir: Path) -> int:
    match = _TAG.match(tag_dir.name)
    return int(match.group(1)) if match else -1


BRANCHES = "branches"  # <checkpoint dir>/branches/<time>-resumed-at-step<N>/: checkpoints of abandoned branches


def not_complete(tag_dir: Path) -> str | None:
    """Why `tag_dir` is not a complete checkpoint, with the newest complete one beside it; None when it is one."""
    if is_complete(tag_dir):
        return None
    marker = tag_dir / COMPLETE_MARKER
    why = f"its {COMPLETE_MARKER} is empty or unreadable" if marker.exists() else f"it has no {COMPLETE_MARKER}"
    others = [c for c in complete_checkpoints(tag_dir.parent) if c != tag_dir]
    fallback = f"; the newest complete checkpoint beside it is {others[-1]}" if others else ""
    return f"{tag_dir} is not a complete checkpoint ({why}: its save was interrupted, or is still running){fallback}"


def step_dirs(checkpoint_dir: Path) -> list[Path]:
    """Every step<N> directory, complete or not, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted((c for c in checkpoint_dir.iterdir() if _TAG.match(c.name) and c.is_dir()), key=_step_of)
