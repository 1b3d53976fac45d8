"""`python -m ds_exp.checkpoint.conversion TAG_DIR --out DIR` (behind ds_exp.universal): ds_to_universal or ds_exp's
stage-0 conversion, the layout fixed for every stage; dies with --parent-pid; a refusal is one line, exit 3."""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import shutil
import signal
import sys
from pathlib import Path
from types import FrameType

import deepspeed
import torch

from ds_exp.checkpoint.checkpointer import CHECKPOINT_TYPES
from ds_exp.checkpoint.universal import (
    EXIT_REFUSED,
    MARKER,
    MODEL_STATES,
    PARAM_NAMES_KEY,
    STATES,
    fingerprint,
)
from ds_exp.core import compat
from ds_exp.core.errors import ResumeError, first_line
from ds_exp.core.files import json_text

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int, scratch: Path | None) -> None:
    """Linux only: the parent's death (SIGKILL too) ends this process, its workers and `scratch`."""
    if not sys.platform.startswith("linux"):
        return

    libc = ctypes.CDLL(None, use_errno=True)
    owner = os.getpid()

    def on_parent_death(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:  # a forked worker inherited this handler: it dies as by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for worker in multiprocessing.active_children():
            worker.kill()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_parent_death)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    os.register_at_fork(after_in_child=lambda: libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL))
    if os.getppid() != parent_pid:  # it died before the prctl
        on_parent_death(signal.SIGTERM, None)


def build(tag_dir: Path, out: Path, names: list[list[str]] | None, workers: int) -> None:
    """Write the universal copy of `tag_dir` into `out`, its marker last, with the source's fingerprint from before."""
    source = fingerprint(tag_dir)
    with compat.torch_load_weights_only(list(CHECKPOINT_TYPES)):
        if any(tag_dir.glob("*_optim_states.pt")):  # ZeRO 1-3 (and DeepSpeed's bf16 optimizer)
            # its worker processes inherit the weights-only load only when forked
            workers = workers if multiprocessing.get_start_method() == "fork" else 1
            compat.ds_to_universal(tag_dir, out, workers)
            for name in MODEL_STATES:  # DeepSpeed copied them: the same bytes, linked instead of a second copy
                if (out / name).is_file() and (tag_dir / name).is_file():
                    (out / name).unlink()
                    os.link(tag_dir / name, out / name)
        else:
            from_stage0(tag_dir, out, names)
        zero = out / "zero"
        optimizer = torch.load(zero / "optimizer_state.pt")
        steps = sorted(zero.glob("*/step.pt"))
        step = torch.load(steps[0]) if steps else optimizer["optimizer_state_dict"]["state"][0]["step"]
        step = step if torch.is_tensor(step) else torch.tensor(float(step))
        shapes: dict[str, torch.Size] = {}
        if (out / MODEL_STATES[1]).is_file():  # stage 3 wrote flat tensors: their shapes
            for group in torch.load(out / MODEL_STATES[1]).get("param_shapes") or []:
                shapes.update(group)
        for param in (p for p in zero.iterdir() if (p / "exp_avg.pt").is_file()):  # trainable ones
            for key in STATES:
                value = torch.load(param / f"{key}.pt")
                if torch.is_tensor(value):
                    value = value.view(shapes.get(param.name, value.shape))
                    torch.save({"param": value, "cat_dim": 0}, param / f"{key}.pt")
            torch.save(step.clone(), param / "step.pt")
        # both layouts in one file: stage 1/2 read the top level, stage 3 "optimizer_state_dict"
        slim = {k: v for k, v in optimizer.items() if k not in ("optimizer_state_dict", "fp32_flat_groups")}
        slim.setdefault("ds_version", deepspeed.__version__)
        slim["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": optimizer["param_groups"]}
        torch.save(slim, zero / "optimizer_state.pt")
        first = next(out / name for name in MODEL_STATES if (out / name).is_file())
        for name in MODEL_STATES:  # the name each stage's loader looks for
            if not (out / name).is_file():
                os.link(first, out / name)
    marker = {
        "source": str(tag_dir),
        "deepspeed": deepspeed.__version__,
        "source_fingerprint": source["digest"],
        "source_files": source["files"],
    }
    (out / MARKER).write_text(json_text(marker) + "\n")


def from_stage0(tag_dir: Path, out: Path, names: list[list[str]] | None) -> None:
    """Rank 0's model states hold the whole torch optimizer state; `names` says which parameter each index is."""
    source = tag_dir / MODEL_STATES[0]
    states = torch.load(source)
    optimizer = states.get("optimizer") or {}
    torch_state = optimizer.get("optimizer_state_dict", optimizer)
    masters = optimizer.get("fp32_groups")
    names = names if names is not None else states.get(PARAM_NAMES_KEY)
    if names is None:
        raise ResumeError(
            f"{tag_dir} is a ZeRO-0 checkpoint written before ds_exp recorded its parameter names, so it cannot be "
            "converted ahead; a resume with the new layout converts it by itself (resume=<it> with the new zero= "
            "or world size)"
        )
    if "param_groups" not in torch_state or not isinstance(masters, (list, type(None))):
        raise ResumeError(f"resume: {tag_dir} holds no stage-0 optimizer state that ds_exp can convert")
    for g, (group, group_names) in enumerate(zip(torch_state["param_groups"], names, strict=True)):
        for j, (index, name) in enumerate(zip(group["params"], group_names, strict=True)):
            state = torch_state["state"][index]
            master = (masters[g][j] if masters else states["module"][name]).float()
            if master.shape != state["exp_avg"].shape:
                raise ResumeError(f"resume: {tag_dir}: optimizer state {index} does not fit parameter {name}")
            (out / "zero" / name).mkdir(parents=True)
            for key, value in zip(STATES, (master, state["exp_avg"], state["exp_avg_sq"]), strict=True):
                torch.save({"param": value, "cat_dim": 0}, out / "zero" / name / f"{key}.pt")
            torch.save(state["step"], out / "zero" / name / "step.pt")
    torch.save({"param_groups": torch_state["param_groups"]}, out / "zero" / "optimizer_state.pt")
    os.link(source, out / MODEL_STATES[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ds_exp.checkpoint.conversion")
    parser.add_argument("tag_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--param-names", type=Path, help="JSON: parameter names per optimizer group (stage 0)")
    parser.add_argument("--parent-pid", type=int, help="die with this process (Linux)")
    parser.add_argument("--scratch", type=Path, help="the directory to remove when dying with the parent")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid, args.scratch)
    names = json.loads(args.param_names.read_text()) if args.param_names else None
    try:
        build(args.tag_dir, args.out, names, args.workers)
    except ResumeError as err:
        print(first_line(err), file=sys.stderr)
        sys.exit(EXIT_REFUSED)


if __name__ == "__main__":
    main()
