"""Resume after the world size, ZeRO stage or offload changed: rank 0 converts the checkpoint once, in a subprocess, to
DeepSpeed's universal format (<tag>.universal/). Stage 0 is converted and loaded by ds_exp."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from deepspeed import DeepSpeedEngine

from ds_exp.checkpoint.checkpointer import CHECKPOINT_TYPES, fast_forward_schedule, load_rng_states, load_weights_only
from ds_exp.config.memory_plan import human_bytes
from ds_exp.config.paths import PACKAGE_DIR
from ds_exp.core import compat
from ds_exp.core.errors import ResumeError, first_line
from ds_exp.core.files import disk_free_bytes, json_text
from ds_exp.launch.console import entry_point
from ds_exp.launch.flags import FlagParser, path, whole
from ds_exp.resume.settings import not_universal
from ds_exp.resume.store import COMPLETE_MARKER, not_complete, read_marker, step_dirs
from ds_exp.runtime.process_group import broadcast

log = logging.getLogger(__name__)

SUFFIX = ".universal"  # <checkpoint dir>/<tag>.universal: the converted copy of <tag>
MARKER = "ds_exp_universal.json"  # inside it, written last, before the rename that makes it visible
STATES = ("fp32", "exp_avg", "exp_avg_sq")
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # stage <=2, stage 3
# a ZeRO-0 checkpoint's client state: the parameter names of its optimizer's indices, per group (ds_exp.train.recipe)
PARAM_NAMES_KEY = "ds_exp_param_names"
# .<tag>.universal.tmp-<host>-<pid>: the converting process (the checkpoint may be on a file system several hosts share)
_TMP = re.compile(r"^\.(?P<target>.+\.universal)\.tmp-(?P<host>.+)-(?P<pid>\d+)$")
EXIT_REFUSED = 3  # universal_build's exit code for a one-line refusal (its last stderr line)


def universal_dir(tag_dir: Path) -> Path:
    return tag_dir.parent / f"{tag_dir.name}{SUFFIX}"


def fingerprint(tag_dir: Path) -> dict[str, Any]:
    """What identifies this checkpoint, cheaply: each file's (size, mtime ns), digested with the completeness marker."""
    files = {
        str(p.relative_to(tag_dir)): [p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(tag_dir.rglob("*"))
        if p.is_file()
    }
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode())
    with contextlib.suppress(OSError):  # no marker: require_complete refuses such a checkpoint anyway
        digest.update((tag_dir / COMPLETE_MARKER).read_bytes())
    return {"files": files, "digest": digest.hexdigest()}


def conversion_status(tag_dir: Path) -> tuple[bool, str | None]:
    """(whether tag_dir's conversion can be used, why not): (False, None) when there is none."""
    udir = universal_dir(tag_dir)
    if not udir.exists():
        return False, None
    try:
        marker = json.loads((udir / MARKER).read_text())
    except (OSError, ValueError):
        return False, f"{udir} is incomplete (no readable {MARKER})"
    recorded = marker.get("source_fingerprint") if isinstance(marker, dict) else None
    if not recorded:
        return False, f"{udir} records no fingerprint of its source (an older ds_exp made it), so it is not trusted"
    now = fingerprint(tag_dir)
    if now["digest"] == recorded:
        return True, None
    before = marker.get("source_files") or {}
    changed = sorted(name for name in set(before) | set(now["files"]) if before.get(name) != now["files"].get(name))
    what = ", ".join(changed[:4]) + (" ..." if len(changed) > 4 else "") if changed else "its marker"
    return False, f"{udir} is stale: {tag_dir} changed since it was converted ({what})"


def is_converted(tag_dir: Path) -> bool:
    """A complete conversion of exactly this checkpoint is there."""
    return conversion_status(tag_dir)[0]


def require_complete(tag_dir: Path) -> None:
    """Refuse an incomplete checkpoint: no marker, or an empty or unreadable one (a save interrupted or running)."""
    why = not_complete(tag_dir)
    if why is not None:
        raise ResumeError(f"{why}; it is not converted")


def remove_stale_temporaries(directory: Path) -> None:
    """Remove this host's .<tag>.universal.tmp-<host>-<pid> directories whose process is gone; other hosts' stay."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    for entry in entries:
        match = _TMP.match(entry.name)
        if match and match.group("host") == socket.gethostname() and not _alive(int(match.group("pid"))):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def space_needed(tag_dir: Path) -> int:
    """About the most a conversion occupies: optimizer states twice plus model states, 10% on top (measured)."""
    sizes = {p.name: p.stat().st_size for p in tag_dir.iterdir() if p.is_file()}
    optim = sum(size for name, size in sizes.items() if name.endswith("_optim_states.pt"))
    model = sum(size for name, size in sizes.items() if name.endswith("_model_states.pt"))
    return int(1.1 * (2 * optim + model if optim else model))


def _no_space(tag_dir: Path, needed: int, free: int) -> ResumeError:
    return ResumeError(
        f"no room to convert {tag_dir} beside it: the conversion needs about {human_bytes(needed)} on the disk of "
        f"{tag_dir.parent}, {human_bytes(free)} free; free some space there, or copy the checkpoint directory "
        "to a larger disk and convert it there"
    )


def ds_config_for_load(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The engine's DeepSpeed config; a stage-0 engine cannot load universal checkpoints: load() does it."""
    if not ds_config.get("zero_optimization", {}).get("stage"):
        return ds_config
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def param_names(model: torch.nn.Module, groups: list[dict[str, Any]]) -> list[list[str]]:
    """Parameter names per optimizer group, in optimizer order: what a stage-0 checkpoint's indices stand for."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in groups]


def convert(tag_dir: Path, *, rank: int, param_names: list[list[str]] | None = None) -> bool:
    """Collective and idempotent: rank 0 converts unless a complete conversion is there; True when one was reused."""
    outcome: tuple[bool, str | None] = (False, None)
    if rank == 0:
        reused, stale = conversion_status(tag_dir)
        try:
            if not reused:
                if stale:
                    log.warning("resume: %s; converting it again", stale)
                log.info("resume: converting %s to DeepSpeed's universal format (once) ...", tag_dir)
                convert_here(tag_dir, param_names)
            log.info("resume: %s %s", "reusing the conversion" if reused else "converted into", universal_dir(tag_dir))
            outcome = (reused, None)
        except (ResumeError, OSError) as err:
            outcome = (False, str(err))
    reused, error = broadcast(outcome)  # the others wait here (dist.timeout_minutes at most)
    if error:
        raise ResumeError(error)
    return reused


def convert_here(tag_dir: Path, names: list[list[str]] | None = None, workers: int = 2) -> Path:
    """Convert in a subprocess into a temporary sibling, then rename; a stale conversion is replaced."""
    tag_dir = tag_dir.resolve()
    target = universal_dir(tag_dir)
    require_complete(tag_dir)
    why = not_universal(read_marker(tag_dir).get("settings") or {})
    if why is not None:  # ds_to_universal would fail on its missing Adam moments
        raise ResumeError(f"{tag_dir} is not converted: {why}")
    if is_converted(tag_dir):
        return target
    remove_stale_temporaries(tag_dir.parent)
    needed = space_needed(tag_dir)
    work = tag_dir.parent / f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.mkdir()
    except OSError as err:
        raise ResumeError(
            f"resume: {tag_dir} must be converted to DeepSpeed's universal format beside it, but {tag_dir.parent} is "
            f"not writable ({err.strerror}); copy the checkpoint directory somewhere writable and resume from there"
        ) from None
    try:
        free = disk_free_bytes(work)
        if free < needed:
            raise _no_space(tag_dir, needed, free)
        args = [str(tag_dir), "--out", str(work / "out"), "--workers", str(workers)]
        args += ["--scratch", str(work), "--parent-pid", str(os.getpid())]  # it dies with this process, and cleans up
        if names is not None:
            (work / "param_names.json").write_text(json_text(names))
            args += ["--param-names", str(work / "param_names.json")]
        path = [str(PACKAGE_DIR.parent), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # not a rank of this job
            env.pop(name, None)
        # run() kills it on any exception here (a stop signal, Ctrl-C) before the cleanup below
        proc = subprocess.run(
            [sys.executable, "-m", "ds_exp.checkpoint.conversion", *args], capture_output=True, text=True, env=env
        )
        if proc.returncode != 0:
            output = (proc.stdout + proc.stderr).strip()
            if proc.returncode == EXIT_REFUSED:
                raise ResumeError(output.splitlines()[-1])
            if "No space left on device" in output or os.strerror(errno.ENOSPC) in output:
                taken = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
                raise _no_space(tag_dir, needed, disk_free_bytes(work) + taken)
            tail = "\n".join(output.splitlines()[-8:])
            raise ResumeError(f"resume: converting {tag_dir} to DeepSpeed's universal format failed:\n{tail}")
        if is_converted(tag_dir):  # another process converted it meanwhile: theirs is as good
            return target
        shutil.rmtree(target, ignore_errors=True)  # a stale one, or a leftover without its marker: never trusted
        os.replace(work / "out", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def load(engine: DeepSpeedEngine, tag_dir: Path) -> dict[str, Any]:
    """Collective: the converted copy into `engine` (built with ds_config_for_load); its client state."""
    udir = universal_dir(tag_dir)
    load_weights_only(engine)
    with compat.torch_load_weights_only(list(CHECKPOINT_TYPES)):
        if not engine.zero_optimization_stage():
            return _load_stage0(engine, udir)
        if not engine.load_universal_checkpoint():
            raise ResumeError("resume: the engine was built without checkpoint.load_universal (ds_config_for_load)")
        path, client = engine.load_checkpoint(str(udir.parent), tag=udir.name, load_lr_scheduler_states=False)
        if path is None:
            raise ResumeError(f"resume: DeepSpeed found no checkpoint in {udir}")
        if engine.zero_optimization_partition_weights():
            saved = torch.load(udir / "zero" / "optimizer_state.pt")["param_groups"]
            compat.fix_zero3_universal_load(engine, saved)
    return client or {}


def _load_stage0(engine: DeepSpeedEngine, udir: Path) -> dict[str, Any]:
    optimizer = engine.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "fp32_groups"):
        raise ResumeError(
            "resume: converting a checkpoint into ZeRO stage 0 works in fp32 only; resume with zero=stage1 or higher"
        )
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
    engine.global_steps, engine.skipped_steps = states["global_steps"], states["skipped_steps"]
    engine.global_samples = states.get("global_samples", engine.global_steps * engine.train_batch_size())
    return {k: v for k, v in states.items() if k not in ("module", "optimizer")}


def restore_rng(
    tag_dir: Path, *, rank: int, world_size: int, saved_world_size: int | None, seed: int, step: int
) -> None:
    """This rank's saved RNG states when the world size is unchanged; else a seed from (seed, step, rank)."""
    if world_size == saved_world_size and load_rng_states(tag_dir, rank):
        return
    fresh = int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:8], "little") >> 1
    random.seed(fresh)
    np.random.seed(fresh % 2**32)
    torch.manual_seed(fresh)


def load_state(
    engine: DeepSpeedEngine,
    tag_dir: Path,
    *,
    rank: int,
    world_size: int,
    seed: int,
    model: torch.nn.Module,
    groups: list,
) -> dict:
    """Collective: convert (once), load, set RNG states, fast-forward the schedule; its TrainState."""
    if rank == 0:
        warning = compat.check_universal_version()
        if warning:
            log.warning(warning)
    convert(tag_dir, rank=rank, param_names=param_names(model, groups))
    try:
        client = load(engine, tag_dir)
    except pickle.UnpicklingError as err:
        raise ResumeError(
            f"resume: {universal_dir(tag_dir)} holds objects a conversion by ds_exp never holds, so it was not loaded "
            f"({first_line(err)}); delete it to convert {tag_dir} again"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:  # a file truncated or deleted since
        first = first_line(err)
        raise ResumeError(
            f"resume: {universal_dir(tag_dir)} cannot be loaded ({first}); delete it to convert {tag_dir} again"
        ) from None
    marker = read_marker(tag_dir)
    saved = client.get("ds_exp") or marker
    restore_rng(
        tag_dir,
        rank=rank,
        world_size=world_size,
        saved_world_size=(marker.get("settings") or {}).get("world_size"),
        seed=seed,
        step=int(saved["step"]),
    )
    if engine.lr_scheduler is not None:  # engine.skipped_steps: restored by load() with the engine's counters
        fast_forward_schedule(engine.lr_scheduler, int(saved["step"]), getattr(engine, "skipped_steps", 0) or 0)
    log.info("resumed from %s (universal copy) at step %s", tag_dir, saved["step"])
    return saved


MAX_WORKERS = 256  # processes DeepSpeed's conversion starts: more than the machine has only queue


def cli_target(path: Path) -> Path:
    """The checkpoint the command line names, or a message saying what to name instead."""
    if not path.exists():
        raise ResumeError(f"{path} does not exist; give one checkpoint directory, e.g. <run>/checkpoints/step<N>")
    if not path.is_dir():
        raise ResumeError(f"{path} is a file; give one checkpoint directory, e.g. <run>/checkpoints/step<N>")
    if re.fullmatch(r"step\d+", path.name) or (path / COMPLETE_MARKER).exists() or any(path.glob("*model_states.pt")):
        return path  # a checkpoint, complete or not (convert_here refuses an incomplete one)
    for holder in (path, path / "checkpoints"):
        tags = [t.name for t in step_dirs(holder)]
        if tags:
            return _name_one(path, holder, tags)
    raise ResumeError(f"{path} holds no checkpoint; give one checkpoint directory, e.g. <run>/checkpoints/step<N>")


def _name_one(path: Path, holder: Path, tags: list[str]) -> Path:
    shown = ", ".join(tags[:8]) + (" ..." if len(tags) > 8 else "")
    raise ResumeError(
        f"{path} is {'a checkpoints directory' if holder == path else 'a run directory'}, not one checkpoint: it "
        f"holds {shown}; convert one of them, e.g. python -m ds_exp.universal {holder / tags[-1]}"
    )


@entry_point("ds_exp.universal")
def main(argv: list[str] | None = None) -> int:
    """`python -m ds_exp.universal TAG_DIR`: convert a checkpoint ahead of a resume that changes its layout."""
    parser = FlagParser(
        prog="python -m ds_exp.universal",
        description="Convert one complete ds_exp checkpoint into DeepSpeed's universal format, cached beside it as "
        "<tag>.universal/, ahead of a resume with another world size, ZeRO stage or offload (a resume converts by "
        "itself otherwise, while the other ranks wait). A conversion that is there and matches the checkpoint is "
        "reused; a stale one is replaced.",
    )
    parser.add_argument("checkpoint", type=path, help="one checkpoint directory: <run dir>/checkpoints/step<N>")
    parser.add_argument(
        "--workers", type=whole(1, MAX_WORKERS), default=2, help="DeepSpeed's extraction processes (default 2)"
    )
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ds_exp.universal: %(message)s"))
    log.addHandler(handler)
    level, log.propagate = log.level, False
    log.setLevel(logging.INFO)
    try:
        tag_dir = cli_target(args.checkpoint).resolve()
        require_complete(tag_dir)
        reused, stale = conversion_status(tag_dir)
        if reused:
            log.info("%s is converted already (its fingerprint matches)", tag_dir)
        else:
            if stale:
                log.warning("%s; converting it again", stale)
            log.info("converting %s to DeepSpeed's universal format ...", tag_dir)
        print(convert_here(tag_dir, workers=args.workers))
    except ResumeError as err:
        message = str(err).removeprefix("resume: ")
        print(f"ds_exp.universal: error: {message}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("ds_exp.universal: interrupted; nothing was converted or left behind", file=sys.stderr)
        return 130
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = True
    return 0
