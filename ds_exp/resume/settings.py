"""What a checkpoint was written with, and whether this run can continue from it. Each marker records the settings that
fix the shapes and partitioning of what it holds. A changed layout (world size, ZeRO stage, offload) is converted once
to DeepSpeed's universal format (Adam's moments only; not under sequence parallelism); any other change is refused
before anything is written, naming each. Light."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ds_exp.config.batch import data_parallel_size, global_batch_size
from ds_exp.config.ds_config import merged_ds_config
from ds_exp.config.lora_checks import scope_of
from ds_exp.config.model_checks import looks_like_local_path
from ds_exp.config.optimizers import OPTIMIZERS
from ds_exp.config.precision import decide_precision, detect_accelerator, supports_bf16
from ds_exp.config.schema import Config, LoraConfig, ModelConfig, plain_tree
from ds_exp.config.secrets import redact
from ds_exp.core.errors import ConfigError, ResumeError
from ds_exp.resume.store import find_resume_checkpoint, read_marker
from ds_exp.resume.trajectory import check

# setting -> why a checkpoint cannot be loaded with another value
_WHY = {
    "model": "the weights belong to another model",
    "vocab_multiple": "the embedding has another number of rows",
    "lora": "the adapters have other shapes or targets",
    "precision": "DeepSpeed keeps other master copies and optimizer states",
    "optimizer": "its state belongs to another optimizer",
}
# the layout: a change is followed by a conversion to DeepSpeed's universal checkpoint format
LAYOUT = ("world_size", "zero_stage", "offload")


def model_section(model: ModelConfig) -> dict[str, Any]:
    """The `model` section as plain JSON values (credentials blanked), as each checkpoint records it."""
    found = redact(plain_tree(asdict(model)))
    return found if isinstance(found, dict) else {}


def settings_of(cfg: Config, world_size: int, ds_config: dict[str, Any], precision: str | None) -> dict[str, Any]:
    """The settings a checkpoint depends on (see the module docstring), as plain JSON values."""
    model = cfg.model.name_or_path or plain_tree(cfg.model.arch)
    lora = lora_settings(cfg.lora, cfg.model.lora_scope) if cfg.lora.dim > 0 else None
    zero = ds_config.get("zero_optimization", {})
    return {
        "model": model,
        "vocab_multiple": int(cfg.model.vocab_multiple),
        "lora": lora,
        "zero_stage": zero.get("stage"),
        "offload": {
            "optimizer": zero.get("offload_optimizer", {}).get("device", "none"),
            "param": zero.get("offload_param", {}).get("device", "none"),
        },
        "precision": precision,
        "optimizer": str(cfg.optimizer.name),
        "world_size": world_size,
        "sequence_parallel_size": int(cfg.dist.sequence_parallel_size),
    }


def lora_settings(lora: LoraConfig, model_scope: str | None = None) -> dict[str, Any]:
    """What LoRA's checkpoint depends on; later settings only off their defaults, so older checkpoints compare equal."""
    found: dict[str, Any] = {
        "dim": int(lora.dim),
        "alpha": float(lora.alpha if lora.alpha is not None else lora.dim),
        "module_name": scope_of(lora, model_scope),  # the scope in effect (`layers.` unless said otherwise)
        "only_optimize": bool(lora.only_optimize),
    }
    extra = {
        "target_modules": plain_tree(lora.target_modules),
        "modules_to_save": list(lora.modules_to_save),
        "use_dora": bool(lora.use_dora),
        "use_rslora": bool(lora.use_rslora),  # no other shapes, but another scaling: another trajectory
        "quantize": lora.quantize,
    }
    return {**found, **{key: value for key, value in extra.items() if value not in (None, [], False)}}


def changes(saved: dict[str, Any], current: dict[str, Any], *, hashed: bool = False) -> list[str]:
    """One line per recorded setting that differs (a model path the same however spelled, or anywhere with `hashed`)."""
    lines = []
    for key, why in _WHY.items():
        if key not in saved or (key != "lora" and (saved[key] is None or current.get(key) is None)):
            continue
        before, now = saved[key], current[key]
        if (
            key == "model"
            and isinstance(before, str)
            and isinstance(now, str)
            and (hashed or _place(before) == _place(now))
        ):
            continue
        if _norm(before) != _norm(now):
            lines.append(f"{key}: {_show(before)} in the checkpoint, {_show(now)} now ({why})")
    return lines


def _place(name: str) -> str:
    return os.path.normpath(os.path.expanduser(name))


def base_gone(name: str | None) -> bool:
    """Whether `name` (a model.name_or_path) is a local directory that no longer exists."""
    return name is not None and looks_like_local_path(name) and not Path(name).expanduser().exists()


def moved_base(model: ModelConfig, to: str | None) -> ModelConfig:
    """A run's saved `model` section with the base where it is now (`to`: --base DIR); refused when it is gone."""
    if to is None:
        if base_gone(model.name_or_path):
            raise ConfigError(
                f"the base model directory is gone: {model.name_or_path} (the run's model.name_or_path) no longer "
                "exists; give --base DIR, where it is now"
            )
        return model
    if model.name_or_path is None:
        raise ConfigError("--base: the run built its model from model.arch, without a base directory; leave it out")
    place = Path(to).expanduser().absolute()
    if not (place / "config.json").is_file():
        raise ConfigError(f"--base={to}: no config.json there; give the directory {model.name_or_path} moved to")
    tokenizer = model.tokenizer
    if tokenizer is not None and _place(tokenizer) == _place(model.name_or_path):
        tokenizer = str(place)
    return replace(model, name_or_path=str(place), tokenizer=tokenizer)


def layout_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line per layout setting (world size, ZeRO stage, offload) that differs; unrecorded ones are not compared."""
    return [
        f"{key}: {_show(saved[key])} in the checkpoint, {_show(current[key])} now"
        for key in LAYOUT
        if saved.get(key) is not None and current.get(key) is not None and _norm(saved[key]) != _norm(current[key])
    ]


def sequence_parallel_change(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """A line when dist.sequence_parallel_size changed (a checkpoint without it was written with 1)."""
    before, now = saved.get("sequence_parallel_size", 1), current.get("sequence_parallel_size", 1)
    if before == now:
        return None
    return (
        f"dist.sequence_parallel_size: {before} in the checkpoint, {now} now (loaded as it is: ZeRO partitions over "
        "every rank whatever the sequence-parallel size)"
    )


def universal_problem(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why a changed layout cannot be converted with sequence parallelism (DeepSpeed 0.19.8 takes its groups for TP)."""
    before, now = saved.get("sequence_parallel_size", 1), current.get("sequence_parallel_size", 1)
    if (before == 1 and now == 1) or not needs_universal(saved, current):
        return None
    layout = "; ".join(layout_changes(saved, current))
    return (
        f"the checkpoint's layout changed ({layout}) and dist.sequence_parallel_size is {before} in the "
        f"checkpoint, {now} now: DeepSpeed 0.19.8 cannot convert or load a universal checkpoint under sequence "
        "parallelism (it takes the sequence-parallel groups for tensor parallelism). Resume on "
        f"{saved.get('world_size')} rank(s) with its ZeRO stage and offload (any dist.sequence_parallel_size that "
        "divides the world size, with the same global batch), or continue from the run's export in a new run"
    )


def not_universal(saved: dict[str, Any]) -> str | None:
    """Why a checkpoint's optimizer state cannot go through DeepSpeed's universal format (unrecorded: AdamW, it can)."""
    name = saved.get("optimizer") or "adamw"
    entry = OPTIMIZERS.get(str(name))
    if entry is None or entry.universal:
        return None
    return (
        f"the checkpoint holds optimizer={name}'s state, which DeepSpeed 0.19.8's universal checkpoints cannot carry "
        "(they hold Adam's two moments only)"
    )


def optimizer_universal_problem(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """A line when the checkpoint's layout changed and its optimizer's state cannot be converted."""
    why = not_universal(saved)
    if why is None or not needs_universal(saved, current) or saved.get("optimizer") != current.get("optimizer"):
        return None
    layout = "; ".join(layout_changes(saved, current))
    return (
        f"the checkpoint's layout changed ({layout}) and {why}: resume on {saved.get('world_size')} rank(s) with its "
        "ZeRO stage and offload (at ZeRO stage 0 on both sides, any world size), or continue from the run's export "
        "in a new run"
    )


def needs_universal(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether the checkpoint must go through the universal format to load with `current` (not ZeRO 0 on both sides)."""
    found = layout_changes(saved, current)
    both_stage0 = saved.get("zero_stage") == 0 and current.get("zero_stage") == 0
    return bool(found) and not (both_stage0 and all(line.startswith("world_size:") for line in found))


def _norm(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _show(value: Any) -> str:
    if value is None:
        return "none"
    return json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)


def check_resume(resume: str | None, tag_dir: Path, current: dict[str, Any]) -> None:
    """Refuse to continue from `tag_dir` (what `resume` names) when a setting it depends on changed."""
    marker = read_marker(tag_dir)
    saved, hashed = marker.get("settings") or {}, bool((marker.get("base") or {}).get("sha256"))
    model = saved.get("model")
    if hashed and isinstance(model, str) and base_gone(model) and _place(model) == _place(str(current.get("model"))):
        raise ResumeError(
            f"resume={resume}: the base model directory is gone: {model} (the base {tag_dir} was trained on) no "
            "longer exists; point model.name_or_path at where it is now (its weights are checked against the "
            "SHA-256 the checkpoint records)"
        )
    found = changes(saved, current, hashed=hashed)
    for problem in (universal_problem(saved, current), optimizer_universal_problem(saved, current)):
        if problem is not None:
            found.append(problem)
    if found:
        raise ResumeError(
            "\n".join(
                [
                    f"resume={resume}: {tag_dir} was written with other settings, so it cannot be loaded:",
                    *(f"- {line}" for line in found),
                    "fix: resume with the settings it was written with, or start a new run in a new directory "
                    "(hydra.run.dir=...) without resume",
                ]
            )
        )


def check_resume_target(cfg: Config, run_dir: Path, world: int) -> None:
    """The checkpoint `resume` names exists, is complete and was written with this run's settings and global batch."""
    tag_dir = find_resume_checkpoint(cfg.resume, run_dir, cfg.train.checkpoint_dir)
    if tag_dir is None:
        return
    accelerator = detect_accelerator()
    precision = decide_precision(cfg.precision.dtype, accelerator, supports_bf16(accelerator))
    check_resume(cfg.resume, tag_dir, settings_of(cfg, world, merged_ds_config(cfg.deepspeed), precision))
    saved = read_marker(tag_dir).get("trajectory")
    if saved:
        batch = global_batch_size(cfg.train, data_parallel_size(world, int(cfg.dist.sequence_parallel_size)))
        check(
            cfg.resume, {"global_batch": saved.get("global_batch")}, {"global_batch": batch, "data": None}, 0, tag_dir
        )
