"""Exported models on disk, told without torch: which directories are ds_exp's exports (the only ones an export may
replace), where the exports made during training go and which of them rotation removes, and what
`python -m ds_exp.export` / `python -m ds_exp.chat` are pointed at (a checkpoint, found in a run directory, its
checkpoints directory or named by its step<N> tag, or set aside in a branch; a run's composed config, with the model
section the checkpoint was trained with; a model directory and its positions), and which exports a resume from an
older checkpoint sets aside with its branch.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ds_exp.config.model_checks import (
    WEIGHT_FILES,
    position_limit,
    read_config_json,
    scaled_positions,
    weights_problem,
)
from ds_exp.config.resolvers import register_resolvers
from ds_exp.config.schema import Config, ModelConfig, as_dict, schema_for, to_config
from ds_exp.config.secrets import ENV_PREFIX, redact
from ds_exp.core.errors import ConfigError, RunFailed, first_line
from ds_exp.resume.branches import BRANCH_EXPORTS
from ds_exp.resume.store import BRANCHES, COMPLETE_MARKER, complete_checkpoints, is_complete, read_marker

METADATA = "ds_exp_export.json"  # written into every export, last before the rename that makes it visible
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: an adapter directory
RUN_CONFIG = Path(".hydra") / "config.yaml"
WRITTEN_BY_RUN = "run"  # origin.written_by of the exports a run makes (rotation removes only those of its own run)


def adapter_dir(export_dir: Path) -> Path:
    """Where the LoRA adapter of an export goes: beside the merged model (written by every export of a LoRA run)."""
    return export_dir.with_name(f"{export_dir.name}_adapter")


def step_export_dir(export_dir: Path, step: int) -> Path:
    """The export of step N made during training (train.export_every), beside the final one."""
    return export_dir.with_name(f"{export_dir.name}-step{step}")


def is_export(path: Path) -> bool:
    return (path / METADATA).is_file() or (path / ADAPTER_CONFIG).is_file()


def check_target(
    export_dir: Path,
    *,
    key: str = "train.export_dir",
    fix: str = "move it away or point train.export_dir elsewhere",
    adapter: bool = True,
) -> None:
    """An export replaces `export_dir` (and with `adapter` its _adapter sibling) only when it is an earlier export:
    whatever else is there is not ds_exp's to delete."""
    for path in (export_dir, adapter_dir(export_dir)) if adapter else (export_dir,):
        if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not is_export(path))):
            raise RunFailed(f"{key}: {path} exists and is not an export of a ds_exp run, so it is not replaced; {fix}")


def read_metadata(export_dir: Path) -> dict[str, Any]:
    """An export's ds_exp_export.json; {} when missing or unreadable (a model from elsewhere)."""
    try:
        found = json.loads((export_dir / METADATA).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def step_exports(export_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of the step exports beside `export_dir`, oldest first; the directory of the merged model
    (<export_dir>-step<N>), which a LoRA run's step export may leave out, writing only its adapter beside it."""
    pattern = re.compile(rf"^{re.escape(export_dir.name)}-step(\d+)(_adapter)?$")
    if not export_dir.parent.is_dir():
        return []
    found = {
        int(m.group(1)): export_dir.with_name(f"{export_dir.name}-step{m.group(1)}")
        for p in export_dir.parent.iterdir()
        if (m := pattern.match(p.name)) and p.is_dir()
    }
    return sorted(found.items())


def rotated_step_exports(export_dir: Path, run_id: str | None, keep_last: int) -> list[Path]:
    """The step exports rotation removes: this run's (their metadata names it) beyond the newest `keep_last`
    (0 keeps all), each with its adapter sibling. Exports of other runs, and `python -m ds_exp.export`'s, stay."""
    if keep_last <= 0 or run_id is None:
        return []
    mine = []
    for _, path in step_exports(export_dir):
        origin = (read_metadata(path) or read_metadata(adapter_dir(path))).get("origin") or {}
        if origin.get("written_by") == WRITTEN_BY_RUN and origin.get("run_id") == run_id:
            mine.append(path)
    doomed = mine[:-keep_last]
    return [p for p in doomed if p.exists()] + [adapter_dir(p) for p in doomed if is_export(adapter_dir(p))]


def exports_off_trajectory(export_dir: Path, run_dir: Path, step: int, *, same_directory: bool) -> list[Path]:
    """The exports beside `export_dir` made on the branch a resume from the checkpoint at `step` abandons: the run's
    own and `python -m ds_exp.export`'s (their metadata names the run directory and the step) past `step`, or all of
    this run directory's when the resume comes from another directory's checkpoint (`same_directory` False); each
    with its adapter sibling. Left where they are, the new branch's exports of the same steps would replace them."""
    found = []
    for path in [export_dir, *(p for _, p in step_exports(export_dir))]:
        for candidate in (path, adapter_dir(path)):
            origin = read_metadata(candidate).get("origin") if is_export(candidate) else None
            if not isinstance(origin, dict) or not origin.get("run_dir") or not isinstance(origin.get("step"), int):
                continue
            if Path(str(origin["run_dir"])).resolve() != run_dir.resolve():
                continue  # another run's, or one that does not say: not this trajectory's to set aside
            if not same_directory or origin["step"] > step:
                found.append(candidate)
    return found


def branch_of(tag_dir: Path) -> Path | None:
    """The branch directory (<checkpoints>/branches/<branch>/) holding `tag_dir`, None for a checkpoint in charge."""
    return tag_dir.parent if tag_dir.parent.parent.name == BRANCHES else None


def default_export_dir(run_dir: Path, cfg: Config, tag_dir: Path, step: int) -> Path:
    """Where `python -m ds_exp.export` puts the export of `tag_dir` without a DIR: <run dir>/<export_dir>-step<N>,
    or for a checkpoint set aside with an abandoned branch, beside that branch's own exports (the trajectory in
    charge has exports of its own at the same steps)."""
    export_dir = run_dir / cfg.train.export_dir
    branch = branch_of(tag_dir)
    if branch is not None:
        return branch / BRANCH_EXPORTS / f"{export_dir.name}-step{step}"
    return step_export_dir(export_dir, step)


def check_outside_checkpoints(target: Path, checkpoint_dir: Path, key: str) -> None:
    """An export never goes inside a checkpoint directory: saves, rotation, resume and branch set-asides own what is
    there (an export named step<N> would pass for a checkpoint, one named step<N>.universal be deleted with it). The
    one place inside it that takes exports is a set-aside branch's exports/ folder, which nothing rotates."""
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


# ------------------------------------------------------------------------------ what the commands are pointed at


def find_checkpoint(given: str) -> Path:
    """A complete checkpoint: `given` itself (a step<N> tag), or the newest complete one in `given` (a checkpoints
    directory) or under its run's checkpoint directory (a run directory). One message when there is none."""
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
        candidates.append(path / str(_raw_config(path).get("train", {}).get("checkpoint_dir", "checkpoints")))
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
    """The run directory whose train.checkpoint_dir holds `tag_dir`, directly or in a branch set aside there
    (branches/<branch>/): its composed config rebuilds the model."""
    holder = tag_dir.resolve().parent
    for parent in tag_dir.resolve().parents:
        if (parent / RUN_CONFIG).is_file():
            checkpoints = (parent / str(_raw_config(parent).get("train", {}).get("checkpoint_dir", ""))).resolve()
            if holder == checkpoints or holder.parent == checkpoints / BRANCHES:
                return parent
    raise ConfigError(
        f"{tag_dir}: no run directory above it ({RUN_CONFIG} of the run whose train.checkpoint_dir holds it): the "
        "run's config is needed to rebuild its model; export from inside the run directory the checkpoint came from"
    )


def checkpoint_step(tag_dir: Path) -> int:
    return int(read_marker(tag_dir)["step"])


def _config_files(run_dir: Path) -> tuple[Path, Path]:
    """(config.yaml, hydra.yaml) of the run's latest attempt: a resume saves its own under .hydra/resume-<time>/."""
    latest = sorted((run_dir / ".hydra").glob("resume-*/config.yaml"))
    folder = latest[-1].parent if latest else run_dir / ".hydra"
    return folder / "config.yaml", folder / "hydra.yaml"


def _raw_config(run_dir: Path) -> dict[str, Any]:
    try:
        raw = OmegaConf.to_container(OmegaConf.load(_config_files(run_dir)[0]), resolve=False)
    except Exception:  # a damaged file: run_config says it in words
        return {}
    return {str(k): v for k, v in raw.items()} if isinstance(raw, dict) else {}


def model_section(cfg: Config) -> dict[str, Any]:
    """The config's `model` section as plain JSON values (credentials blanked): what each checkpoint records of the
    model it trained (TrainState.model_config)."""
    found = redact(as_dict(cfg)["model"])
    return found if isinstance(found, dict) else {}


def run_config(run_dir: Path, tag_dir: Path | None = None) -> Config:
    """The run's composed config, typed; with `tag_dir`, with the `model` section that checkpoint was trained with
    (a later attempt may have changed model.rope_scaling, ...; a checkpoint of an older ds_exp records none, and the
    run's latest config stands). Relative paths are taken from where the run was launched; secrets hidden as
    ${oc.env:DS_EXP_SECRET_...} are dropped (nothing here needs them, and their variables are gone)."""
    config_file, hydra_file = _config_files(run_dir)
    recorded = read_marker(tag_dir).get("model_config") if tag_dir is not None else None
    try:
        raw = _without_secrets(OmegaConf.to_container(OmegaConf.load(config_file), resolve=False))
        if isinstance(recorded, dict) and isinstance(raw, dict):
            known = set(ModelConfig.__dataclass_fields__)
            raw["model"] = {**(raw.get("model") or {}), **{k: v for k, v in recorded.items() if k in known}}
        register_resolvers()
        cfg = to_config(OmegaConf.merge(schema_for(raw), OmegaConf.create(raw)))
    except ConfigError:
        raise
    except Exception as err:
        first = first_line(err)
        raise ConfigError(f"{config_file}: the run's config cannot be read ({first})") from None
    launched_in = _launch_dir(hydra_file)
    if launched_in is not None:
        for section, key in (("model", "name_or_path"), ("model", "tokenizer"), ("data", "cache_dir")):
            value = getattr(getattr(cfg, section), key)
            if value and not Path(value).expanduser().is_absolute() and (launched_in / value).exists():
                setattr(getattr(cfg, section), key, str(launched_in / value))
    return cfg


def _launch_dir(hydra_file: Path) -> Path | None:
    try:
        cwd = OmegaConf.load(hydra_file).hydra.runtime.cwd
    except Exception:  # no hydra.yaml (hydra.output_subdir=null): relative paths are taken from here
        return None
    return Path(str(cwd)) if cwd else None


def _without_secrets(value: object) -> Any:
    if isinstance(value, dict):
        return {k: _without_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_secrets(v) for v in value]
    return None if isinstance(value, str) and ENV_PREFIX in value else value


def model_dir_of(given: str) -> Path:
    """What `python -m ds_exp.chat` talks to: a Hugging Face model directory, or a run directory's final export."""
    path = Path(given).expanduser()
    if (path / "config.json").is_file():
        return path
    if (path / ADAPTER_CONFIG).is_file():
        raise ConfigError(
            f"{given} is a LoRA adapter, not a whole model: chat with a merged export (python -m ds_exp.export "
            "CHECKPOINT, without --adapter) or the run's hf_model"
        )
    if (path / RUN_CONFIG).is_file():
        export_dir = path / str(_raw_config(path).get("train", {}).get("export_dir", "hf_model"))
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
    """The config.json of the model `python -m ds_exp.chat` talks to, once its weights are known to be whole: one
    message for a config.json that is not JSON, no weights, or weights cut short (an export whose save never
    finished, a copy interrupted), before transformers is imported."""
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
    """(positions, what they are) of a model's config.json: the tokens a prompt and its answer share. A learned
    position table ends there (past it, an IndexError); a rotary model was trained to there, stretched by its
    rope scaling's factor when it has one. None when nothing limits them (ALiBi, relative positions)."""
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
