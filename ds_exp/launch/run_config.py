"""A run directory remembers its run: `python -m ds_exp hydra.run.dir=R resume=auto [KEY=VALUE ...]` continues
with R's own composed config (the newest attempt's .hydra/[resume-<time>/]config.yaml), not the defaults; the
overrides given with it are changes, each named here, and then applied or refused by the resume rules
(ds_exp.resume.trajectory: length, learning rate, schedule; ds_exp.resume.settings: what the checkpoint's layout
depends on). A sweep job resuming in its own directory does the same (ds_exp.sweeps.jobs).
Light: no torch, no deepspeed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ds_exp.config.secrets import ENV_PREFIX
from ds_exp.core.errors import ConfigError, first_line

_SECRET_REF = re.compile(r"\$\{oc\.env:(" + ENV_PREFIX + r"\w+)")


def saved_run_config(run_dir: Path) -> Path | None:
    """The config the run's newest attempt composed: .hydra/resume-<time>/config.yaml (a resume's), else
    .hydra/config.yaml (the first attempt's); None when the directory holds neither."""
    later = sorted((run_dir / ".hydra").glob("resume-*/config.yaml"))
    if later:
        return later[-1]
    first = run_dir / ".hydra" / "config.yaml"
    return first if first.is_file() else None


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(node, dict) and node:
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
    else:
        out[prefix.rstrip(".")] = node
    return out


def _changed_key(key: str) -> str:
    """The key a value override replaces whole: an item of a list replaces its list (YAML sets no single item)."""
    parts = key.split(".")
    for depth in range(1, len(parts)):
        if parts[depth].isdigit():
            return ".".join(parts[:depth])
    return key


def continue_run_config(config: DictConfig, run_dir: Path, overrides: list[str]) -> list[str] | None:
    """In place: `config`'s task keys become those of the run saved in `run_dir`, then the `overrides` given now
    (group choices and values, as Hydra composed them now) are applied again over them. Returns one line per key
    whose value now differs from the run's; None (and `config` unchanged) when the directory saved no config."""
    path = saved_run_config(run_dir)
    if path is None:
        return None
    task_keys = [str(key) for key in config if key != "hydra"]
    now = OmegaConf.masked_copy(config, task_keys)
    try:
        saved = OmegaConf.load(path)
        merged = OmegaConf.merge(now, saved)  # typed as now: a key the schema lost is named, not taken silently
        if not isinstance(merged, DictConfig):
            raise ValueError("not a mapping of settings")
    except Exception as err:  # any failure to read or merge: one message naming the file
        raise ConfigError(
            f"resume: hydra.run.dir={run_dir} holds a config ds_exp cannot continue from ({path}: "
            f"{first_line(err)}); fix or remove that file, or start a new run in another directory"
        ) from None
    choices = config.hydra.runtime.choices if "hydra" in config else {}
    ignored: list[str] = []
    for item in OverridesParser.create().parse_overrides(overrides):
        key = item.key_or_group
        if key.startswith("hydra") or item.is_sweep_override():
            continue
        if key in choices:  # a group choice: that group's node, as its new option composes it
            package = item.package or key.replace("/", ".")
            if key == "experiment" or package in ("_global_", ""):  # presets are `# @package _global_`
                ignored.append(f"{item.input_line} (it sets keys all over the config: give the keys to change)")
                continue
            OmegaConf.update(merged, package, OmegaConf.select(now, package), merge=False)
        elif item.is_delete():
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(merged, parent) if parent else merged
            if isinstance(node, DictConfig) and leaf in node:
                with open_dict(node):
                    del node[leaf]
        else:
            whole = _changed_key(key)
            OmegaConf.update(merged, whole, OmegaConf.select(now, whole), merge=False, force_add=True)
    _keep_secrets_reachable(merged, now)
    before = _flat(OmegaConf.to_container(saved, resolve=False))
    after = _flat(OmegaConf.to_container(merged, resolve=False))
    lines = [
        f"{key}: {before.get(key, '(unset)')} -> {after.get(key, '(unset)')}"
        for key in sorted(before.keys() | after.keys())
        if before.get(key, ...) != after.get(key, ...) and key in after and key != "resume"
    ]
    lines += [f"not applied: {line}" for line in ignored]
    with read_write(config), open_dict(config):
        for key in task_keys:
            config[key] = merged[key]
    return lines


def _keep_secrets_reachable(merged: DictConfig, now: DictConfig) -> None:
    """A credential given to the first attempt on its command line was saved as a reference to a variable of that
    process (DS_EXP_SECRET_*); where that variable is gone now, the value comes from this composition instead."""
    for key, value in _flat(OmegaConf.to_container(merged, resolve=False)).items():
        if isinstance(value, str) and any(name not in os.environ for name in _SECRET_REF.findall(value)):
            OmegaConf.update(merged, key, OmegaConf.select(now, key, default=None), merge=False)


def resume_note(run_dir: Path, lines: list[str]) -> str:
    """What a resume continues with, in one message."""
    source = saved_run_config(run_dir)
    where = source.relative_to(run_dir) if source is not None else ".hydra/config.yaml"
    if not lines:
        return f"resume: hydra.run.dir={run_dir} continues with its own config ({where}), unchanged"
    return "\n".join(
        [f"resume: hydra.run.dir={run_dir} continues with its own config ({where}), changed by this command line:"]
        + [f"  {line}" for line in lines]
    )


def named_run_dir(config: DictConfig) -> Path | None:
    """The run directory the command line named (hydra.run.dir=R), None when Hydra chose it. A rank > 0 of a
    torchrun launch runs in a placeholder named after it (launch.run_dir.rank_placeholder_overrides): the first
    one named is the user's, whose saved config every rank continues from alike."""
    for override in config.hydra.overrides.hydra:
        key, _, value = str(override).lstrip("+").partition("=")
        if key == "hydra.run.dir":
            return Path(value)
    return None
