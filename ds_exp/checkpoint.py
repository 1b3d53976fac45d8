"""DeepSpeed checkpoints with a completeness marker, rotation and resume.

`engine.save_checkpoint` writes <dir>/<tag>/. A checkpoint counts as complete only once every rank has
finished writing and rank 0 has written <tag>/ds_exp_complete.json; only then does rank 0 point <dir>/latest
at it (DeepSpeed's own `latest`, written before anything is known to be complete, is switched off). Resume
never picks a directory without the marker, so a crash in the middle of a save leaves the previous checkpoint
in charge, and `latest` still names it (for tools that read DeepSpeed's layout, such as zero_to_fp32.py).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_exp.atomic import write_json_atomic, write_text_atomic
from ds_exp.errors import ResumeError, RunFailed

log = logging.getLogger(__name__)

COMPLETE_MARKER = "ds_exp_complete.json"
LATEST = "latest"  # DeepSpeed's name for the file that holds the newest tag
# Fault injection for the reliability tests: DS_EXP_FAULT=save:<tag>[@<rank>] kills this process (SIGKILL, as
# the OOM killer or a node failure would) once DeepSpeed has written checkpoint <tag>, before it is complete.
_FAULT_ENV = "DS_EXP_FAULT"
_TAG = re.compile(r"^step(\d+)$")


@dataclass(frozen=True)
class TrainState:
    """Where training stands: enough to continue exactly as if it had never stopped."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch
    step_in_epoch: int = 0  # optimizer steps done within `epoch`
    wandb_run_id: str | None = None
    # the loss sums of the metric window still open when a stop signal came, so that the resumed run's next
    # metric line covers the same steps as an uninterrupted run's (summed over ranks)
    window_loss_sum: float = 0.0
    window_label_tokens: float = 0.0
    initial_eval: dict[str, float] | None = None  # the run's first evaluation, for its summary after a resume
    # what the run's course depends on (ds_exp.trajectory): a resume says what changed, or refuses
    trajectory: dict[str, Any] | None = None
    # the run that wrote the checkpoint (kept across resumes): rotation only ever deletes this run's checkpoints
    run_id: str | None = None
    # what the checkpoint depends on (ds_exp.resume.settings_of): a resume with other values is refused
    settings: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def tag_for(step: int) -> str:
    return f"step{step}"


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = []
    for child in checkpoint_dir.iterdir():
        match = _TAG.match(child.name)
        if match and (child / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def read_marker(tag_dir: Path) -> dict[str, Any]:
    """The completeness marker of a checkpoint (its TrainState); {} when unreadable."""
    try:
        return json.loads((tag_dir / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}


def find_resume_checkpoint(resume: str | None, run_dir: Path, checkpoint_subdir: str) -> Path | None:
    """The checkpoint tag directory to resume from; None to start fresh (resume=null, or auto with none yet)."""
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir / checkpoint_subdir)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if (path / COMPLETE_MARKER).is_file():
        return path
    for candidate in (path, path / checkpoint_subdir):
        found = complete_checkpoints(candidate)
        if found:
            return found[-1]
    raise ResumeError(
        f"resume={resume}: no complete checkpoint in {path} (looked for step<N>/{COMPLETE_MARKER} there and "
        f"under {checkpoint_subdir}/); give a run directory, its checkpoints directory or one step<N> directory"
    )


def rng_states() -> dict[str, Any]:
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [np.random.get_state()[0], np.random.get_state()[1].tolist(), *np.random.get_state()[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(_as_tuples(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def save(engine: Any, checkpoint_dir: Path, state: TrainState, *, rank: int, keep_last: int) -> Path:
    """Collective: every rank must call it. Returns the tag directory."""
    import torch
    import torch.distributed as dist

    tag = tag_for(state.step)
    path = checkpoint_dir / tag
    if (path / COMPLETE_MARKER).is_file():  # a complete checkpoint is never rewritten in place
        if read_marker(path).get("run_id") == state.run_id:  # this run's, run again after it finished
            log.info("checkpoint %s is complete already; not saved again", path)
            return path
        raise RunFailed(
            f"{path} is a complete checkpoint of another run, so it is not overwritten; point train.checkpoint_dir "
            "at a directory of this run's own"
        )
    engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state={"ds_exp": state.as_dict()}, save_latest=False)
    # per-rank RNG states, loadable with torch.load(weights_only=True)
    torch.save(rng_states(), path / f"rng_rank{rank}.pt")
    inject_fault(f"save:{tag}", rank)
    dist.barrier()
    if rank == 0:
        write_json_atomic(path / COMPLETE_MARKER, state.as_dict())
        write_text_atomic(checkpoint_dir / LATEST, tag)
        # only checkpoints this run wrote: a checkpoint directory shared with another run keeps that run's
        own = [c for c in complete_checkpoints(checkpoint_dir) if read_marker(c).get("run_id") == state.run_id]
        for old in own[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(old.parent / f"{old.name}.universal", ignore_errors=True)  # its conversion (ds_exp.universal)
    dist.barrier()
    log.info("saved checkpoint %s", path)
    return path


class Checkpointer:
    """This run's checkpoints: where, how many to keep, and what each records besides DeepSpeed's state."""

    def __init__(
        self,
        engine: Any,
        directory: Path,
        *,
        rank: int,
        keep_last: int,
        needed_bytes: int,
        identity: dict[str, Any],
    ) -> None:
        """`identity`: what every checkpoint of this run records besides where it stands (TrainState's run_id,
        wandb_run_id, settings and trajectory)."""
        self.engine, self.directory, self.rank, self.keep_last = engine, directory, rank, keep_last
        self.needed_bytes, self.identity = needed_bytes, identity

    def save(self, progress: Any, window: tuple[float, float], initial_eval: dict[str, float] | None) -> Path:
        """Collective. `progress`: step, epoch, step_in_epoch; `window`: the open metric window's sums over ranks.
        A save that fails for lack of room or rights is one message, and leaves no incomplete checkpoint."""
        from ds_exp.storage import save_failure_message

        state = TrainState(
            step=progress.step,
            epoch=progress.epoch,
            step_in_epoch=progress.step_in_epoch,
            window_loss_sum=window[0],
            window_label_tokens=window[1],
            initial_eval=initial_eval,
            **self.identity,
        )
        try:
            return save(self.engine, self.directory, state, rank=self.rank, keep_last=self.keep_last)
        except (OSError, RuntimeError) as exc:
            tag_dir = self.directory / tag_for(progress.step)
            _release_files(exc)
            if self.rank == 0 and not (tag_dir / COMPLETE_MARKER).is_file():
                shutil.rmtree(tag_dir, ignore_errors=True)  # never complete: give its space back
            message = save_failure_message(exc, tag_dir, self.needed_bytes)
            if message is None:
                raise
            raise RunFailed(message) from exc


def _release_files(exc: BaseException) -> None:
    """Close the files a failed save left open: the frames of its traceback hold torch.save's writer, and a
    deleted file that is still open keeps its space on the disk."""
    import gc
    import traceback

    seen: BaseException | None = exc
    while seen is not None:
        traceback.clear_frames(seen.__traceback__)
        seen = seen.__cause__ or seen.__context__
    gc.collect()


def inject_fault(point: str, rank: int) -> None:
    """SIGKILL this process at `point` when DS_EXP_FAULT names it (and this rank, if it names one)."""
    wanted = os.environ.get(_FAULT_ENV)
    if not wanted:
        return
    name, _, only_rank = wanted.partition("@")
    if name == point and (not only_rank or int(only_rank) == rank):
        import signal

        log.error("fault injection (%s=%s): killing rank %d", _FAULT_ENV, wanted, rank)
        os.kill(os.getpid(), signal.SIGKILL)


def load_weights_only(engine: Any) -> None:
    """DeepSpeed reads checkpoint files with torch.load(weights_only=False), which runs whatever a pickle says.
    A resume reads files an earlier process wrote, so ds_exp has it read them with weights_only=True instead,
    allowing only the few DeepSpeed types its checkpoints hold."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from ds_exp import compat

    compat.read_checkpoints_weights_only(engine, [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address])


def damaged_message(tag_dir: Path, err: BaseException) -> str:
    """A checkpoint marked complete that cannot be read (a file truncated or deleted since): name the fallback."""
    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
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


def load(engine: Any, tag_dir: Path, *, rank: int) -> TrainState:
    """Collective: restores module, optimizer, LR scheduler and this rank's RNG states."""
    import torch

    load_weights_only(engine)
    try:
        # the LR schedule is not loaded but fast-forwarded to the step (ds_exp.trajectory): a schedule is a function of
        # the step, and a resume that changes the run's length or learning rate must take effect
        load_path, client_state = engine.load_checkpoint(
            str(tag_dir.parent), tag=tag_dir.name, load_lr_scheduler_states=False
        )
    except pickle.UnpicklingError as err:
        raise ResumeError(
            f"resume: {tag_dir} holds objects a checkpoint written by ds_exp never holds, so it was not loaded "
            f"(torch.load with weights_only=True: {str(err).splitlines()[0]}); resume only from checkpoints you trust"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:  # a truncated or missing file
        raise ResumeError(damaged_message(tag_dir, err)) from None
    if load_path is None:
        raise ResumeError(f"resume: DeepSpeed found no checkpoint in {tag_dir}; it may be from another run layout")
    rng_file = tag_dir / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_states(torch.load(rng_file, weights_only=True))
    saved = (client_state or {}).get("ds_exp") or json.loads((tag_dir / COMPLETE_MARKER).read_text())
    if engine.lr_scheduler is not None:
        # the schedule is recomputed under the run's settings (a resume may change them on purpose, trajectory.py):
        # step it as often as the engine did, i.e. not on the steps the fp16 loss scaler skipped (restored above)
        with warnings.catch_warnings():  # it warns that no optimizer step came first: on purpose here
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            for _ in range(int(saved["step"]) - int(getattr(engine, "skipped_steps", 0) or 0)):
                engine.lr_scheduler.step()
    log.info("resumed from %s at step %s", tag_dir, saved["step"])
    return TrainState(**saved)
