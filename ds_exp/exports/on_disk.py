"""Exports on disk, without torch: which directories are ds_exp's exports, where step exports go, their size,
rotation and branches, and a run's config from its directory."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ds_exp.config.resolvers import register_resolvers
from ds_exp.config.schema import Config, ModelConfig, schema_for, to_config
from ds_exp.config.secrets import ENV_PREFIX
from ds_exp.core.errors import ConfigError, first_line
from ds_exp.core.files import read_json_object
from ds_exp.exports.settings import ExportSettings
from ds_exp.launch.run_config import saved_run_config
from ds_exp.resume.branches import BRANCH_EXPORTS
from ds_exp.resume.store import BRANCHES, read_marker

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


def read_metadata(export_dir: Path) -> dict[str, Any]:
    """An export's ds_exp_export.json; {} when missing or unreadable (a model from elsewhere)."""
    return read_json_object(export_dir / METADATA) or {}


def planned_step_exports(settings: ExportSettings, run_dir: Path, start_step: int, total_steps: int) -> list[Path]:
    """The step exports a run from `start_step` to `total_steps` will write (the last step has the final export)."""
    every, export_dir = settings.export_every, run_dir / settings.export_dir
    if not every:
        return []
    return [step_export_dir(export_dir, s) for s in range((start_step // every + 1) * every, total_steps, every)]


def one_export_bytes(
    settings: ExportSettings, lora_dim: int, parameters: int, trainable: int, precision: str, *, final: bool
) -> int:
    """What one export of the run writes: the model in the training dtype, or the adapter (and merged model)."""
    adapter = trainable * 4 if lora_dim > 0 else 0  # what trains, in fp32 (PEFT's files, as trained)
    return adapter + (parameters * (4 if precision == "fp32" else 2) if settings.merges(lora_dim, final=final) else 0)


def step_exports(export_dir: Path) -> list[tuple[int, Path]]:
    """(step, <export_dir>-step<N>) of the step exports beside `export_dir`, oldest first."""
    pattern = re.compile(rf"^{re.escape(export_dir.name)}-step(\d+)(_adapter)?$")
    if not export_dir.parent.is_dir():
        return []
    found = {
        int(m.group(1)): step_export_dir(export_dir, int(m.group(1)))
        for p in export_dir.parent.iterdir()
        if (m := pattern.match(p.name)) and p.is_dir()
    }
    return sorted(found.items())


def rotated_step_exports(export_dir: Path, run_id: str | None, keep_last: int) -> list[Path]:
    """This run's step exports beyond the newest `keep_last` (0 keeps all), with adapters; others' stay."""
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
    """This run directory's exports a resume from `step` abandons (the new branch's exports would replace them)."""
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


def default_export_dir(export_dir: Path, tag_dir: Path, step: int) -> Path:
    """`python -m ds_exp.export`'s default: <export_dir>-step<N>, or beside an abandoned branch's own exports."""
    branch = tag_dir.parent
    if branch.parent.name == BRANCHES:
        return branch / BRANCH_EXPORTS / f"{export_dir.name}-step{step}"
    return step_export_dir(export_dir, step)


def checkpoint_step(tag_dir: Path) -> int:
    return int(read_marker(tag_dir)["step"])


def _config_files(run_dir: Path) -> tuple[Path, Path]:
    """(config.yaml, hydra.yaml) of the run's newest attempt (ds_exp.launch.run_config.saved_run_config)."""
    config = saved_run_config(run_dir) or run_dir / RUN_CONFIG
    return config, config.with_name("hydra.yaml")


def train_section(run_dir: Path) -> dict[str, Any]:
    """The `train` section of the run's latest config, uninterpolated; {} where it cannot be read."""
    try:
        raw = OmegaConf.to_container(OmegaConf.load(_config_files(run_dir)[0]), resolve=False)
    except Exception:
        return {}
    train = raw.get("train") if isinstance(raw, dict) else None
    return {str(k): v for k, v in train.items()} if isinstance(train, dict) else {}


def run_config(run_dir: Path, tag_dir: Path | None = None) -> Config:
    """The run's composed config, typed (with `tag_dir`, that checkpoint's `model` section); hidden secrets dropped."""
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
    try:
        cwd = OmegaConf.load(hydra_file).hydra.runtime.cwd
    except Exception:  # no hydra.yaml (hydra.output_subdir=null): relative paths are taken from here
        cwd = None
    if cwd:
        launched_in = Path(str(cwd))
        for section, key in (("model", "name_or_path"), ("model", "tokenizer"), ("data", "cache_dir")):
            value = getattr(getattr(cfg, section), key)
            if value and not Path(value).expanduser().is_absolute() and (launched_in / value).exists():
                setattr(getattr(cfg, section), key, str(launched_in / value))
    return cfg


def _without_secrets(value: object) -> Any:
    if isinstance(value, dict):
        return {k: _without_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_secrets(v) for v in value]
    return None if isinstance(value, str) and ENV_PREFIX in value else value
