"""What an export or a chat refuses before torch, one line each: a target that is not an earlier export or lies in the
checkpoint directory, and what the commands are pointed at."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ds_exp.config.model_checks import WEIGHT_FILES, position_limit, read_config_json, scaled_positions, weights_problem
from ds_exp.core.errors import ConfigError, RunFailed
from ds_exp.exports.on_disk import ADAPTER_CONFIG, RUN_CONFIG, adapter_dir, is_export, train_section
from ds_exp.resume.branches import BRANCH_EXPORTS
from ds_exp.resume.store import BRANCHES, COMPLETE_MARKER, complete_checkpoints, is_complete


def check_target(
    export_dir: Path,
    *,
    key: str = "train.export_dir",
    fix: str = "move it away or point train.export_dir elsewhere",
    adapter: bool = True,
) -> None:
    """An export replaces `export_dir` (with `adapter`: its _adapter sibling too) only when it is an earlier export."""
    for path in (export_dir, adapter_dir(export_dir)) if adapter else (export_dir,):
        if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not is_export(path))):
            raise RunFailed(f"{key}: {path} exists and is not an export of a ds_exp run, so it is not replaced; {fix}")


def check_outside_checkpoints(target: Path, checkpoint_dir: Path, key: str) -> None:
    """Never inside a checkpoint directory (it would pass for a checkpoint), except a set-aside branch's exports/."""
    real, checkpoints = Path(os.path.realpath(target)), Path(os.path.realpath(checkpoint_dir))
    if not real.is_relative_to(checkpoints):
        return
    parts = real.relative_to(checkpoints).parts
    if len(parts) >= 4 and parts[0] == BRANCHES and parts[2] == BRANCH_EXPORTS:
        return
    raise ConfigError(
        f"{key}: {target} is inside the checkpoint directory {checkpoint_dir}, which saves, rotation and resumes own; "
        "give a directory outside it (e.g. beside the run's hf_model)"
    )


def find_checkpoint(given: str) -> Path:
    """A complete checkpoint: `given`, or the newest in a checkpoints or run directory; else one message."""
    path = Path(given).expanduser()
    if not path.exists():
        raise ConfigError(f"{given}: no such directory; give a run directory, its checkpoints directory or a step<N>")
    if (path / COMPLETE_MARKER).exists() or any(path.glob("*model_states.pt")):  # a tag
        if is_complete(path):
            return path
        earlier = complete_checkpoints(path.parent)
        fallback = f"the newest complete one is {earlier[-1]}" if earlier else "there is no complete one beside it"
        raise ConfigError(
            f"{given} is an incomplete checkpoint: its {COMPLETE_MARKER} is missing or damaged (its save never "
            f"finished, or a file was lost since), so nothing is exported from it; {fallback}"
        )
    candidates = [path]
    if (path / RUN_CONFIG).is_file():
        candidates.append(path / str(train_section(path).get("checkpoint_dir", "checkpoints")))
    candidates.append(path / "checkpoints")
    for candidate in candidates:
        found = complete_checkpoints(candidate)
        if found:
            return found[-1]
    raise ConfigError(
        f"{given}: no complete checkpoint there (looked for step<N>/{COMPLETE_MARKER} in it and in its run's "
        "checkpoint directory); give a run directory, its checkpoints directory or a step<N> that finished saving"
    )


def run_dir_of(tag_dir: Path) -> Path:
    """The run directory whose train.checkpoint_dir holds `tag_dir` (directly or in a set-aside branch)."""
    holder = tag_dir.resolve().parent
    for parent in tag_dir.resolve().parents:
        if (parent / RUN_CONFIG).is_file():
            checkpoints = (parent / str(train_section(parent).get("checkpoint_dir", ""))).resolve()
            if holder == checkpoints or holder.parent == checkpoints / BRANCHES:
                return parent
    raise ConfigError(
        f"{tag_dir}: no run directory above it ({RUN_CONFIG} of the run whose train.checkpoint_dir holds it): the "
        "run's config is needed to rebuild its model; export from inside the run directory the checkpoint came from"
    )


def refuse_reward_model(model_dir: Path, so: str, *, reward_run: bool = False) -> None:
    """A reward model (objective=reward) scores answers and writes none: transformers would load it without its head."""
    architectures = (read_config_json(model_dir, str(model_dir))[0] or {}).get("architectures") or []
    if reward_run or (architectures and all(str(a).endswith("ForSequenceClassification") for a in architectures)):
        raise ConfigError(
            f"{model_dir} is a reward model (objective=reward): it scores answers and writes none, so {so}; its "
            "held-out preference accuracy is summary.json's final_eval.reward_accuracy, and transformers' "
            "AutoModelForSequenceClassification scores a pair with it"
        )


def model_dir_of(given: str) -> Path:
    """What `python -m ds_exp.chat` talks to: a Hugging Face model directory, or a run directory's final export."""
    path = Path(given).expanduser()
    if (path / "config.json").is_file():
        return path
    if (path / ADAPTER_CONFIG).is_file():
        raise ConfigError(
            f"{given} is a LoRA adapter, not a whole model: chat with a merged export (python -m ds_exp.export "
            "CHECKPOINT --merged) or the run's hf_model"
        )
    if (path / RUN_CONFIG).is_file():
        export_dir = path / str(train_section(path).get("export_dir", "hf_model"))
        if (export_dir / "config.json").is_file():
            return export_dir
        raise ConfigError(
            f"{given} is a run directory without an export ({export_dir} holds no model yet): make one with "
            f"python -m ds_exp.export {given}"
        )
    raise ConfigError(
        f"{given}: not a Hugging Face model directory (no config.json) nor a run directory (no {RUN_CONFIG}); give "
        "an export such as <run dir>/hf_model, or a run directory"
    )


def model_settings_of(model_dir: Path, given: str) -> dict[str, Any]:
    """The config.json of the model `python -m ds_exp.chat` talks to, its weights checked whole, before transformers."""
    settings, problem = read_config_json(model_dir, given, key=given)
    if problem is None and settings is not None:
        if not any((model_dir / name).is_file() for name in WEIGHT_FILES):
            problem = (
                f"{given}: no weights in it ({', '.join(WEIGHT_FILES)}): not a whole model, or an export whose save "
                "never finished; give another export, or export a checkpoint with python -m ds_exp.export"
            )
        else:
            problem = weights_problem(model_dir, given, key=given)
    if problem is not None or settings is None:
        raise ConfigError(problem or f"{given}: config.json cannot be read")
    return settings


def context_of(settings: dict[str, Any]) -> tuple[int, str] | None:
    """(positions, what they are) a prompt and its answer share, from config.json; None when nothing limits them."""
    found = position_limit(settings)
    if found is None:
        return None
    key, limit, kind = found
    scaling = settings.get("rope_scaling") or settings.get("rope_parameters")
    stretched = scaled_positions(scaling, limit) if kind == "rope" and isinstance(scaling, dict) else None
    if stretched is not None and stretched > limit:
        return stretched, f"{stretched} positions ({key}={limit} stretched by its rope scaling)"
    how = "a learned position table" if kind == "learned" else "its context"
    return limit, f"{limit} positions ({key}={limit}, {how})"
