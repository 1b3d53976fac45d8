"""DeepSpeed checkpoints, complete only once rank 0 marked them (then `latest`): a crash mid-save leaves the previous
one in charge. A resume from an older one moves the later ones into branches/; rotation deletes only this run's."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import pickle
import random
import shutil
import signal
import traceback
import warnings
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from ds_exp.checkpoint.frozen import load_trained, trained_only
from ds_exp.core import compat
from ds_exp.core.errors import ResumeError, RunFailed, first_line
from ds_exp.core.files import write_json_atomic, write_text_atomic
from ds_exp.launch.storage import save_failure_message
from ds_exp.resume.branches import rotated, save_verdict
from ds_exp.resume.store import (
    COMPLETE_MARKER,
    LATEST,
    TrainState,
    damaged_message,
    is_complete,
    tag_for,
)
from ds_exp.runtime.peers import barrier
from ds_exp.runtime.process_group import broadcast

log = logging.getLogger(__name__)


# reliability tests: DS_EXP_FAULT=save:<tag>[@<rank>] SIGKILLs this process after DeepSpeed wrote <tag>, unmarked
_FAULT_ENV = "DS_EXP_FAULT"


def rng_states() -> dict[str, Any]:
    name, keys, *rest = np.random.get_state(legacy=True)  # the legacy tuple: plain values, no dict
    numpy_state = [name, np.asarray(keys).tolist(), *rest]
    state: dict[str, Any] = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    random.setstate(_as_tuples(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def save(
    engine: DeepSpeedEngine,
    checkpoint_dir: Path,
    state: TrainState,
    *,
    rank: int,
    keep_last: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Collective. Returns the tag directory; `extra`: more top-level keys of DeepSpeed's model states file."""
    tag = tag_for(state.step)
    path = checkpoint_dir / tag
    verdict = save_verdict(checkpoint_dir, path, state) if rank == 0 else None
    verdict = broadcast(verdict)
    if verdict == "same":
        return path
    if verdict is not None:
        raise RunFailed(verdict)
    client_state = {"ds_exp": state.as_dict(), **(extra or {})}
    # frozen weights (LoRA's base) left out: rebuilt from the model the run started from (ds_exp.checkpoint.frozen)
    leave_out = {"exclude_frozen_parameters": True} if state.base is not None else {}
    with trained_only(engine.module) if leave_out else contextlib.nullcontext():
        engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state=client_state, save_latest=False, **leave_out)
    # per-rank RNG states, loadable with torch.load(weights_only=True)
    torch.save(rng_states(), path / f"rng_rank{rank}.pt")
    inject_fault(f"save:{tag}", rank)
    barrier(f"the end of the save of {tag}")
    if rank == 0:
        write_json_atomic(path / COMPLETE_MARKER, state.as_dict())
        write_text_atomic(checkpoint_dir / LATEST, tag)  # only now: `latest` names complete checkpoints only
        for old in rotated(checkpoint_dir, state, keep_last):
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(old.parent / f"{old.name}.universal", ignore_errors=True)  # its conversion (ds_exp.universal)
    barrier(f"checkpoint {tag} marked complete")
    log.info("saved checkpoint %s", path)
    return path


class Position(Protocol):
    """Where the loop stands (ds_exp.train.loop.Progress, a higher layer)."""

    step: int
    epoch: int
    step_in_epoch: int


class Steppable(Protocol):
    """An LR scheduler, torch's or DeepSpeed's own (not a torch LRScheduler)."""

    def step(self) -> object: ...


class Checkpointer:
    """This run's checkpoints: where, how many to keep, and what each records besides DeepSpeed's state."""

    def __init__(
        self,
        engine: DeepSpeedEngine,
        directory: Path,
        *,
        rank: int,
        keep_last: int,
        needed_bytes: int,
        identity: dict[str, Any],
        extra: dict[str, Any] | None = None,
    ) -> None:
        """`identity`: what every checkpoint of this run records besides its progress; `extra`: see save()."""
        self.engine, self.directory, self.rank, self.keep_last = engine, directory, rank, keep_last
        self.needed_bytes, self.identity, self.extra = needed_bytes, identity, extra

    def save(self, progress: Position, window: tuple[float, ...], initial_eval: dict[str, float] | None) -> Path:
        """Collective; `window`: the metric window's sums. A failed save (room, rights) leaves nothing incomplete."""
        state = TrainState(
            step=progress.step,
            epoch=progress.epoch,
            step_in_epoch=progress.step_in_epoch,
            window_loss_sum=window[0],
            window_label_tokens=window[1],
            window_sums=list(window[2:]),
            initial_eval=initial_eval,
            **self.identity,
        )
        try:
            return save(self.engine, self.directory, state, rank=self.rank, keep_last=self.keep_last, extra=self.extra)
        except (OSError, RuntimeError) as exc:
            tag_dir = self.directory / tag_for(progress.step)
            _release_files(exc)
            if self.rank == 0 and not is_complete(tag_dir):
                shutil.rmtree(tag_dir, ignore_errors=True)  # never complete: give its space back
            message = save_failure_message(exc, tag_dir, self.needed_bytes)
            if message is None:
                raise
            raise RunFailed(message) from exc


def _release_files(exc: BaseException) -> None:
    """Close the files a failed save left open (its traceback holds them): a deleted open file keeps its space."""
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
        log.error("fault injection (%s=%s): killing rank %d", _FAULT_ENV, wanted, rank)
        os.kill(os.getpid(), signal.SIGKILL)


# The only non-tensor types torch.load may build from a checkpoint's files (weights_only=True), converted or not
CHECKPOINT_TYPES = (ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address)


def load_weights_only(engine: DeepSpeedEngine) -> None:
    """Have DeepSpeed's torch.load use weights_only=True, allowing only CHECKPOINT_TYPES."""
    compat.read_checkpoints_weights_only(engine, list(CHECKPOINT_TYPES))


def load_rng_states(tag_dir: Path, rank: int) -> bool:
    """This rank's RNG states as saved with `tag_dir`; False when it holds none for this rank."""
    rng_file = tag_dir / f"rng_rank{rank}.pt"
    if not rng_file.is_file():
        return False
    set_rng_states(torch.load(rng_file, weights_only=True))
    return True


def fast_forward_schedule(scheduler: Steppable, step: int, skipped_steps: int) -> None:
    """Step a fresh LR scheduler to `step` (less fp16's `skipped_steps`): recomputed, as a resume may change it."""
    with warnings.catch_warnings():  # torch warns that no optimizer step came first: on purpose here
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        for _ in range(int(step) - int(skipped_steps)):
            scheduler.step()


def load_checkpoint(engine: DeepSpeedEngine, tag_dir: Path, *, rank: int) -> TrainState:
    """Collective: restores module, optimizer, LR scheduler and this rank's RNG states."""
    load_weights_only(engine)
    try:
        # the LR schedule is fast-forwarded, not loaded: a resume may change the run's length or learning rate
        load_path, client_state = engine.load_checkpoint(
            str(tag_dir.parent), tag=tag_dir.name, load_lr_scheduler_states=False, custom_load_fn=load_trained
        )
    except pickle.UnpicklingError as err:
        raise ResumeError(
            f"resume: {tag_dir} holds objects a checkpoint written by ds_exp never holds, so it was not loaded "
            f"(torch.load with weights_only=True: {first_line(err)}); resume only from checkpoints you trust"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:  # a truncated or missing file
        raise ResumeError(damaged_message(tag_dir, err)) from None
    if load_path is None:
        raise ResumeError(f"resume: DeepSpeed found no checkpoint in {tag_dir}; it may be from another run layout")
    load_rng_states(tag_dir, rank)
    saved = (client_state or {}).get("ds_exp") or json.loads((tag_dir / COMPLETE_MARKER).read_text())
    if engine.lr_scheduler is not None:  # engine.skipped_steps: restored with the engine's state above
        fast_forward_schedule(engine.lr_scheduler, int(saved["step"]), getattr(engine, "skipped_steps", 0) or 0)
    log.info("resumed from %s at step %s", tag_dir, saved["step"])
    return TrainState(**saved)
