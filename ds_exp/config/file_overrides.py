"""Explicit overrides a user's DeepSpeed file (`deepspeed.config_file`) would silently win over: refused before the
run (IgnoredOverride), each named with what to do instead."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from ds_exp.config.ds_config import (
    MISSING,
    RunFacts,
    expected_values,
    get_path,
    groups_ds_config,
    load_config_file,
    same_value,
)
from ds_exp.config.optimizers import entry_of
from ds_exp.config.paths import conf_dir
from ds_exp.config.resolvers import AUTO
from ds_exp.config.schema import Config, plain
from ds_exp.core.errors import ConfigError


class IgnoredOverride(ConfigError):
    """An override given explicitly (on the command line, or as a sweep's value) that the run would not obey,
    because deepspeed.config_file replaces what it sets."""


_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")
# With its own "optimizer" block DeepSpeed builds the optimizer from the file: ds_exp's choice of it is not used,
# and a hyperparameter the block leaves out is DeepSpeed's default. ("auto" ones and weight_decay, which each
# parameter group carries, are obeyed.)
_OPTIMIZER_BLOCK_REPLACES = ("optimizer", "optimizer.impl", "optimizer.name")


def _optimizer_params(cfg: Config) -> dict[str, str]:
    """ds_exp's optimizer settings that reach DeepSpeed as a block's params: optimizer.<key> -> the param."""
    entry = entry_of(cfg.optimizer)
    arguments = entry.arguments.items() if entry else ()
    return {f"optimizer.{k}": argument for argument, k in arguments if isinstance(k, str) and k != "weight_decay"}


# With its own "scheduler" block the schedule is the file's; only its warmup may come from ds_exp ("auto").
_SCHEDULER_BLOCK_REPLACES = ("scheduler", "scheduler.name", "scheduler.kwargs")
_SCHEDULER_WARMUP = ("scheduler.warmup_steps", "scheduler.warmup_ratio")
# DeepSpeed keys fed by a ds_exp setting that means more than them: train.log_every sets ds_exp's metric lines too
_COSMETIC = {"steps_per_print"}


def override_key(override: str) -> str:
    """The config key of a Hydra override (`+a.b=1`, `~a.b`, `group=option`, `group@pkg=option` -> a.b / group)."""
    key = override.split("=", 1)[0].lstrip("+~").strip()
    return key.split("@", 1)[0]


def _leaves(tree: object, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict) and tree:
        return [leaf for k, v in tree.items() for leaf in _leaves(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), tree)]


def _sources(unresolved: object, path: str) -> set[str]:
    """The ds_exp keys the groups' value at `path` of deepspeed.config comes from (conf/config.yaml interpolates
    them: `stage: ${zero.stage}`), plus the key that sets it directly (deepspeed.config.<path>)."""
    keys = {f"deepspeed.config.{path}"}
    node = unresolved
    for part in path.split("."):
        if isinstance(node, str):
            break
        if not isinstance(node, dict) or part not in node:
            return keys
        node = node[part]
    for value in [leaf for _, leaf in _leaves(node)]:
        if isinstance(value, str):
            keys |= set(_REFERENCE.findall(value))
    return keys


def _feeds(key: str, sources: set[str]) -> bool:
    """Whether an override of `key` sets one of `sources`. A group's option (`zero=stage1`) sets many keys, and a
    user's file tuning one of them (a bucket size) is the file's normal use; the option is beaten only where the
    file changes what tells the group's options apart (zero: stage; offload: the devices)."""
    group_keys = _distinguishing_keys(key)
    if group_keys is not None:
        return any(source in group_keys for source in sources)
    return any(source == key or source.startswith(key + ".") for source in sources)


_GROUP_KEYS: dict[str, set[str] | None] = {}


def _distinguishing_keys(group: str) -> set[str] | None:
    """For a config group of conf/ (None for any other key): its keys that every option sets, to values that are
    not all the same."""
    if group not in _GROUP_KEYS:
        folder = conf_dir() / group
        options = sorted(folder.glob("*.yaml")) if "." not in group and folder.is_dir() else []
        if not options:
            _GROUP_KEYS[group] = None
        else:
            trees = [yaml.safe_load(option.read_text()) or {} for option in options]
            leaves = [dict(_leaves({k: v for k, v in tree.items() if k != "defaults"})) for tree in trees]
            common = set.intersection(*(set(leaf) for leaf in leaves))
            _GROUP_KEYS[group] = {
                f"{group}.{key}" for key in common if len({json.dumps(leaf[key]) for leaf in leaves}) > 1
            }
    return _GROUP_KEYS[group]


def overrides_replaced_by_file(composed: DictConfig, cfg: Config, overrides: list[str]) -> list[str]:
    """One line for each explicit override that deepspeed.config_file silently wins over, so that the run would not
    do what it says: a DeepSpeed-only key the file sets to another value (the file wins for those, by design), or
    ds_exp's optimizer / schedule choices where the file brings its own block. Keys ds_exp mirrors (batch sizes,
    lr, precision...) are not here: a file that disagrees on them is an error of resolve_ds_config already.
    `composed` is the composed config before typing (the interpolations say which ds_exp key feeds which
    DeepSpeed key); `overrides` are the run's own (the command line's, or a sweep job's)."""
    if not cfg.deepspeed.config_file or not overrides:
        return []
    file = load_config_file(cfg.deepspeed.config_file)
    where = f"deepspeed.config_file={cfg.deepspeed.config_file}"
    unresolved = OmegaConf.to_container(composed.deepspeed.config, resolve=False)
    groups = groups_ds_config(cfg)
    facts = RunFacts(world_size=1, total_steps=1, warmup_steps=0, precision="fp32")
    mirrored = {e.path for e in expected_values(cfg, facts)}  # agree with ds_exp or are an error already
    replaced: list[tuple[str, Any, set[str]]] = []  # (DeepSpeed key, the file's value, the ds_exp keys it beats)
    for block, value in file.items():
        if block in ("optimizer", "scheduler"):
            continue  # blocks of their own: below
        for path, file_value in _leaves({block: value}):
            if file_value == AUTO or path in mirrored or path in _COSMETIC:
                continue
            ours = get_path(groups, path)  # a subtree where the file puts a value: the file replaces all of it
            if ours is MISSING or file_value == {}:  # nothing of ds_exp's there; an empty block merges nothing
                continue
            if not same_value(ours, file_value):
                replaced.append((path, file_value, _sources(unresolved, path)))
    problems = []
    for override in overrides:
        key = override_key(override)
        if not key or key.startswith(("hydra.", "hydra/")) or key == "deepspeed.config_file":
            continue
        beaten = [(path, value) for path, value, sources in replaced if _feeds(key, sources)]
        if beaten:
            sets = ", ".join(f"{path}={json.dumps(value)}" for path, value in beaten)
            problems.append(
                f"{override} would not be used: {where} sets {sets}, and the file wins over ds_exp's settings for "
                f"DeepSpeed's own keys; drop {override}, or remove {', '.join(p for p, _ in beaten)} from the file"
            )
        why = _replacing_block(file, key, cfg)
        if why:
            problems.append(f"{override} would not be used: {where} {why}")
    return problems


def _replacing_block(file: dict[str, Any], key: str, cfg: Config) -> str | None:
    """Why the file's "optimizer" / "scheduler" block means `key` is not used, with the fix; or None."""
    for block, replaces, owner, params_of in (
        ("optimizer", _OPTIMIZER_BLOCK_REPLACES, cfg.optimizer.owner, _optimizer_params(cfg)),
        (
            "scheduler",
            _SCHEDULER_BLOCK_REPLACES,
            cfg.scheduler.owner,
            dict.fromkeys(_SCHEDULER_WARMUP, "warmup_num_steps"),
        ),
    ):
        found = file.get(block)
        if not isinstance(found, dict):
            continue
        given = found.get("params")
        params: dict[str, Any] = given if isinstance(given, dict) else {}
        if key in replaces or (key == f"{block}.owner" and plain(owner) == "ds_exp"):
            return (
                f"brings its own {block} block ({found.get('type')}), which replaces ds_exp's; drop {key}, or remove "
                f"the file's {block} block"
            )
        if key in params_of and params_of[key] not in params:
            name = params_of[key]
            return (
                f"brings its own {block} block ({found.get('type')}) whose params have no {name}, so DeepSpeed's "
                f'default is used; add "{name}": "auto" to them (ds_exp fills it from {key})'
            )
    return None


def check_overrides_obeyed(composed: DictConfig, cfg: Config, overrides: list[str]) -> None:
    """IgnoredOverride naming each override the user's DeepSpeed file would silently win over (see above)."""
    problems = overrides_replaced_by_file(composed, cfg, overrides)
    if problems:
        raise IgnoredOverride(problems)
