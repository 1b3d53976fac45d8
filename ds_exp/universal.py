"""Resume anywhere (issue 16 §2): continue a checkpoint after the world size, ZeRO stage or offload changed.

Such a checkpoint is converted once into DeepSpeed's universal format, cached in <tag_dir>/universal/ (so rotating
the checkpoint removes it too), and loaded with the DeepSpeed config key checkpoint.load_universal. Stage 0 has no
ZeRO files: its model + torch optimizer state are converted by ds_exp, and a stage-0 engine is loaded by ds_exp.
A stage-0 -> stage-0 world-size change needs nothing (rank 0 saved the whole optimizer). Found with DeepSpeed
0.19.8 on CPU, fixed here: ds_to_universal wants --inject_missing_state (ds_exp's modules carry no
universal_checkpoint_info); its stage <=2 and stage 3 outputs are not loadable by the other stages (model-states file
name, optimizer_state.pt layout, flat state tensors without step.pt); CPU Adam's int step breaks torch AdamW; the
ZeRO-3 loader gives every fp32 partition one shared step tensor (AdamW then counts it once per sub-group, and the
losses drift by ~1e-4) and copies param group 0's hyperparameters (weight decay) to every group; its zero/ files
are read with torch.load(weights_only=False), hence safe_torch_load(). Frozen parameters (LoRA's base) are not
restored from the conversion: they keep the values the model was built with, which is what they were saved with.

Integration into the runner (ds_exp/train.py):
1. Before the model is built (Trainer.prepare, after resolve_ds_config and settings_of): find the checkpoint
   (checkpoint.find_resume_checkpoint, today in run()), refuse what cannot be converted (refused_changes replaces
   resume.changes in check_resume; world_size, zero_stage and offload move out of resume._WHY), and set
   self.universal = needs_universal(saved_settings, self.settings); if so, ds_config = ds_config_for_load(ds_config)
   (what deepspeed.initialize reads) before build_model/build_engine, and ds_config.json records it.
2. After build_model, before build_engine: if self.universal: convert(tag_dir, rank=rank, param_names=
   param_names(model, groups)) with groups = engine.parameter_groups(...) as build_engine makes them (collective).
3. In run(): state = TrainState(**load(engine, tag_dir)["ds_exp"]) instead of checkpoint.load, then
   restore_rng(...) instead of its rng_rank file; map errors as checkpoint.load does. The metric window (sums over
   ranks) and Progress(step, epoch, step_in_epoch) carry over as they are; the sampler start
   step_in_epoch x micro x accum x world counts samples over all ranks, so it holds at an equal global batch.
   A changed global batch would skip or repeat samples and change total_steps and the LR schedule: record the
   global batch in settings_of and refuse it (or announce it, issue 16 §3). The node count needs nothing: files are
   named by global rank. New checkpoints record the new settings, so the next resume is a plain one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ds_exp.errors import ResumeError

UNIVERSAL = "universal"  # <tag_dir>/universal: the converted copy
MARKER = "ds_exp_universal.json"  # inside it, written before the rename that makes it visible
CONVERTIBLE = ("world_size", "zero_stage", "offload")
STATES = ("fp32", "exp_avg", "exp_avg_sq")
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # stage <=2, stage 3


def _differs(saved: dict[str, Any], current: dict[str, Any], key: str) -> bool:
    if saved.get(key) is None or current.get(key) is None:
        return False
    return json.dumps(saved[key], sort_keys=True) != json.dumps(current[key], sort_keys=True)


def needs_universal(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether `saved` (a checkpoint's settings) must be converted to be loaded with `current` settings."""
    if _differs(saved, current, "zero_stage") or _differs(saved, current, "offload"):
        return True
    both_stage0 = saved.get("zero_stage") == 0 and current.get("zero_stage") == 0
    return _differs(saved, current, "world_size") and not both_stage0


def refused_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """resume.changes less what a conversion handles: model, vocabulary, LoRA and precision stay refused."""
    from ds_exp.resume import changes

    return [line for line in changes(saved, current) if not line.startswith(tuple(f"{k}:" for k in CONVERTIBLE))]


def universal_dir(tag_dir: Path) -> Path:
    return tag_dir / UNIVERSAL


def is_converted(tag_dir: Path) -> bool:
    return (universal_dir(tag_dir) / MARKER).is_file()


def ds_config_for_load(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config to build the engine with (read by deepspeed.initialize). A stage-0 engine cannot load
    universal checkpoints (DeepSpeed 0.19.8 skips the weights, then fails): load() does it without the key."""
    if not ds_config.get("zero_optimization", {}).get("stage"):
        return ds_config
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def param_names(model: Any, groups: list[dict[str, Any]]) -> list[list[str]]:
    """Parameter names per optimizer group, in optimizer order: what a stage-0 checkpoint's indices stand for."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in groups]


@contextlib.contextmanager
def safe_torch_load() -> Iterator[None]:
    """DeepSpeed's converter and universal loaders call torch.load(weights_only=False) themselves; for as long as
    this lasts every torch.load reads with weights_only=True, allowing the few DeepSpeed types checkpoints hold."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    allowed, original = [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address], torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        with torch.serialization.safe_globals(allowed):
            return original(*args, **{**kwargs, "weights_only": True})

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def convert(tag_dir: Path, *, rank: int, param_names: list[list[str]] | None = None, workers: int = 4) -> Path:
    """Collective and idempotent: rank 0 converts (unless done before), every rank learns how it went."""
    import torch.distributed as dist

    error = None
    if rank == 0:
        try:
            convert_here(tag_dir, param_names, workers)
        except (ResumeError, OSError) as err:
            error = str(err)
    if dist.is_initialized():  # the others wait here (dist.timeout_minutes at most: convert ahead for huge ones)
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ResumeError(error)
    return universal_dir(tag_dir)


def convert_here(tag_dir: Path, names: list[list[str]] | None = None, workers: int = 4, spawn: bool = True) -> Path:
    """Build into <tag_dir>/.universal.tmp (in a subprocess: memory, DeepSpeed's prints and worker pool stay
    there), then rename: a half-done conversion is never mistaken for a complete one."""
    target, work = universal_dir(tag_dir), tag_dir / f".{UNIVERSAL}.tmp"
    if is_converted(tag_dir):
        return target
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.mkdir()
    except OSError as err:
        raise ResumeError(f"resume: cannot convert {tag_dir} in place ({err}); copy it somewhere writable") from None
    args = [str(tag_dir), "--out", str(work / UNIVERSAL), "--workers", str(workers)]
    if names is not None:
        (work / "param_names.json").write_text(json.dumps(names))
        args += ["--param-names", str(work / "param_names.json")]
    if spawn:
        path = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
        cmd = [sys.executable, "-m", "ds_exp.universal_build", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
            raise ResumeError(f"resume: converting {tag_dir} to DeepSpeed's universal format failed:\n{tail}")
    else:
        from ds_exp.universal_build import main

        main(args)
    shutil.rmtree(target, ignore_errors=True)  # a leftover without its marker
    os.replace(work / UNIVERSAL, target)
    shutil.rmtree(work, ignore_errors=True)
    return target


def load(engine: Any, tag_dir: Path) -> dict[str, Any]:
    """Collective: restore module, optimizer, LR scheduler and engine counters from the converted copy; returns
    the client state (ds_exp's TrainState under "ds_exp"). The engine was built with ds_config_for_load."""
    import torch

    udir = universal_dir(tag_dir)
    with safe_torch_load():
        if not engine.zero_optimization_stage():
            return _load_stage0(engine, udir)
        if not engine.load_universal_checkpoint():
            raise ResumeError("resume: the engine was built without checkpoint.load_universal (ds_config_for_load)")
        path, client = engine.load_checkpoint(str(tag_dir), tag=UNIVERSAL)
        if path is None:
            raise ResumeError(f"resume: DeepSpeed found no checkpoint in {udir}")
        base = engine.optimizer.optimizer
        for state in base.state.values():  # ZeRO-3 gave every partition the same step tensor
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        saved = torch.load(udir / "zero" / "optimizer_state.pt")["param_groups"]
        for group, values in zip(base.param_groups, saved, strict=True):  # ZeRO-3 copied group 0's to all
            group.update({k: v for k, v in values.items() if k != "params"})
    return client or {}


def _load_stage0(engine: Any, udir: Path) -> dict[str, Any]:
    import torch

    optimizer = engine.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "fp32_groups"):
        raise ResumeError("resume: converting into ZeRO stage 0 works in fp32 only; use zero=stage1 or higher")
    names = {id(p): n for n, p in engine.module.named_parameters()}
    zero = udir / "zero"
    saved = torch.load(zero / "optimizer_state.pt")["param_groups"]
    with torch.no_grad():
        for group, values in zip(optimizer.param_groups, saved, strict=True):
            group.update({k: v for k, v in values.items() if k != "params"})
            for p in group["params"]:
                files = {key: torch.load(zero / names[id(p)] / f"{key}.pt") for key in (*STATES, "step")}
                tensors = {key: files[key]["param"].view_as(p).to(p) for key in STATES}
                p.copy_(tensors.pop("fp32"))
                optimizer.state[p] = {"step": files["step"].float().clone(), **tensors}
    states = torch.load(udir / MODEL_STATES[0])
    if engine.lr_scheduler is not None and states.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
    engine.global_steps, engine.skipped_steps = states["global_steps"], states["skipped_steps"]
    engine.global_samples = states.get("global_samples", engine.global_steps * engine.train_batch_size())
    return {k: v for k, v in states.items() if k not in ("module", "optimizer")}


def restore_rng(tag_dir: Path, *, rank: int, world_size: int, saved_world_size: int, seed: int, step: int) -> bool:
    """This rank's saved RNG states when the world size is unchanged (exact); otherwise a reproducible seed from
    (seed, step, rank), since ranks then see other samples anyway (dropout masks differ). True when exact."""
    import random

    import numpy as np
    import torch

    from ds_exp.checkpoint import set_rng_states

    saved = tag_dir / f"rng_rank{rank}.pt"
    if world_size == saved_world_size and saved.is_file():
        set_rng_states(torch.load(saved, weights_only=True))
        return True
    fresh = int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:8], "little") >> 1
    random.seed(fresh)
    np.random.seed(fresh % 2**32)
    torch.manual_seed(fresh)
    return False


if __name__ == "__main__":  # python -m ds_exp.universal TAG_DIR: convert ahead of a resume (a stage-0 one: no)
    print(convert_here(Path(sys.argv[1]), spawn=False))
