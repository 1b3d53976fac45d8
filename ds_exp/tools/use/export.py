"""`python -m ds_exp.export`'s work, in one process on the CPU, without DeepSpeed's engine nor a process group:

1. the model is rebuilt as the run's config builds it (ds_exp.model.build: base weights, padded vocabulary, LoRA);
2. the checkpoint's weights are read: at ZeRO 0-2 rank 0's model states hold the whole module (what the engine
   held, in the training precision); at ZeRO-3 each rank holds a partition of the fp32 master weights, which
   DeepSpeed's zero_to_fp32 stitches together, rounded here to the training precision as the engine's own
   parameters were. Every file is read with torch.load(weights_only=True);
3. they are loaded into the rebuilt model (a checkpoint that does not fit it is refused) and exported by
   ds_exp/artifacts/export.py: the same files the run's own export at that step (train.export_every) holds. A LoRA
   checkpoint holds only what trains: the frozen base is the one rebuilt in step 1, checked to be the one the
   checkpoint was trained on (ds_exp/checkpoint/frozen.py), and taken in the training precision, as the engine
   held it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path
from typing import Any

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from ds_exp.artifacts.export import DTYPES, export_spec, non_finite_tensors, write_export
from ds_exp.checkpoint.checkpointer import CHECKPOINT_TYPES
from ds_exp.checkpoint.frozen import built_base, load_trained
from ds_exp.checkpoint.universal import MODEL_STATES
from ds_exp.config.paths import data_cache_dir
from ds_exp.config.schema import Config
from ds_exp.core import compat
from ds_exp.core.errors import Diverged, RunFailed, first_line
from ds_exp.data.cache import read_meta
from ds_exp.data.templates import first_template, resolve_template
from ds_exp.launch.exports import read_metadata
from ds_exp.model.build import build_model
from ds_exp.model.tokenizer import load_tokenizer
from ds_exp.resume.store import read_marker
from ds_exp.train.generate import stop_token_ids

WRITTEN_BY = "python -m ds_exp.export"


def export_checkpoint(
    tag_dir: Path, run_dir: Path, cfg: Config, target: Path, *, adapter: bool, dtype: str | None
) -> dict[str, Any]:
    """Export the complete checkpoint `tag_dir` of the run in `run_dir` (composed config `cfg`) to `target`;
    returns the export's metadata."""
    hf_logging.disable_progress_bar()
    marker = read_marker(tag_dir)
    settings = marker.get("settings") or {}
    precision = str(settings.get("precision") or "fp32")
    cfg = _in_one_process(cfg)
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    ds_config = {"zero_optimization": {"stage": 0}, **{k: {"enabled": precision == k} for k in ("bf16", "fp16")}}
    built = build_model(cfg, tokenizer, ds_config)
    # the frozen weights it left out
    built_base(cfg.model, cfg.train.seed, built.model, zero3=False, checkpoint=tag_dir, what="export")
    dtype_of_training = getattr(torch, DTYPES[precision])
    state = read_weights(tag_dir, dtype_of_training)
    try:
        load_trained(state, built.model)  # the frozen weights may be left out: they are the ones rebuilt
    except RuntimeError as err:
        problem = " ".join(str(err).split())[:400]
        raise RunFailed(
            f"{tag_dir} does not fit the model the run's config builds ({problem}); was {run_dir}/.hydra changed "
            "since the checkpoint was written?"
        ) from None
    # what the checkpoint left out, as the engine held it: the rebuilt frozen weights in the training precision
    for name, value in built.model.state_dict().items():
        if name not in state:
            state[name] = value.to(dtype_of_training) if value.is_floating_point() else value
    bad = non_finite_tensors(state)
    if bad:
        raise Diverged(
            f"{tag_dir}: the weights are not finite (NaN or inf) in {', '.join(bad[:3])}: that checkpoint diverged "
            "and nothing was exported; export an earlier one"
        )
    trained = {name for name, param in built.model.named_parameters() if param.requires_grad}
    spec = export_spec(
        cfg,
        built,
        precision,
        template=run_template(cfg, marker, tokenizer),
        stop_token_ids=tuple(stop_token_ids(tokenizer, cfg.data.end_of_conversation_token)),
        origin={
            "written_by": WRITTEN_BY,
            "checkpoint": str(tag_dir.resolve()),
            "step": int(marker["step"]),
            "run_dir": str(run_dir.resolve()),
        },
    )
    if dtype is not None:
        spec = dataclasses.replace(spec, dtype=dtype, dtype_key="--dtype")
    del built  # the export builds its own copy: one model in memory at a time, besides the state
    write_export(state, trained, spec, tokenizer, target, adapter_only=adapter)
    return read_metadata(target)


def _in_one_process(cfg: Config) -> Config:
    """The run's config for a rebuild in this process: no sequence-parallel groups (their attention wrapper needs
    the ranks; the weights do not depend on it), no GPU kernels patched in."""
    cfg = dataclasses.replace(cfg)
    sp = int(cfg.dist.sequence_parallel_size)
    cfg.dist = dataclasses.replace(cfg.dist, sequence_parallel_size=1)
    model: dict[str, Any] = {"liger_kernel": False, "fused_loss": False}
    cfg.train = dataclasses.replace(cfg.train, compile=False)
    if cfg.model.attn_implementation == "auto":
        model["attn_implementation"] = None  # flash-attention needs a GPU; the weights do not depend on it
    if sp > 1 and model.get("attn_implementation", cfg.model.attn_implementation) is None:
        model["attn_implementation"] = "sdpa"  # what the run's model was built with (ds_exp.model.build)
    cfg.model = dataclasses.replace(cfg.model, **model)
    return cfg


def read_weights(tag_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full state dict of the module at the checkpoint, in the training precision `dtype`."""
    try:
        with compat.torch_load_weights_only(list(CHECKPOINT_TYPES)):
            states = tag_dir / MODEL_STATES[0]
            if states.is_file():  # ZeRO 0-2: the whole module, as the engine held it
                return dict(torch.load(states, map_location="cpu")["module"])
            quiet = io.StringIO()  # zero_to_fp32 prints and draws progress bars
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:  # a file truncated or deleted since
        first = first_line(err)
        raise RunFailed(
            f"{tag_dir} cannot be read, a file of it is damaged or missing ({first}); export an earlier checkpoint"
        ) from None
    # the engine's ZeRO-3 parameters are these fp32 masters rounded to the training precision
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}


def run_template(cfg: Config, marker: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> str:
    """The template the run asked its model with: the run's tokenized data says it (data.cache_dir, named by the
    checkpoint's trajectory); without it, data.template as the tokenizer decides it."""
    key = (marker.get("trajectory") or {}).get("data")
    meta = read_meta(data_cache_dir(cfg.data.cache_dir) / str(key)) if key else None
    stats = (meta or {}).get("stats") or {}
    return first_template(stats) if stats.get("template") else resolve_template(cfg.data.template, tokenizer)
