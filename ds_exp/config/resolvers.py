"""OmegaConf resolvers used by conf/*.yaml: the DeepSpeed config built by interpolation (conf/config.yaml), and the
default name of an optuna study (conf/hydra/sweeper/optuna.yaml)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from ds_exp.config.optimizers import OPTIMIZERS
from ds_exp.config.schema import plain
from ds_exp.core.files import json_text

AUTO = "auto"

_WARMUP = {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO, "warmup_num_steps": AUTO, "warmup_type": "linear"}
# transformers schedule -> the DeepSpeed scheduler with the same curve ("auto" values filled at run time)
DEEPSPEED_SCHEDULERS: dict[str, dict[str, Any]] = {
    "linear": {"type": "WarmupDecayLR", "params": {"total_num_steps": AUTO, **_WARMUP}},
    "cosine": {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": AUTO,
            "warmup_num_steps": AUTO,
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": 0.0,
            "warmup_type": "linear",
        },
    },
    "constant_with_warmup": {"type": "WarmupLR", "params": dict(_WARMUP)},
    "constant": {"type": "WarmupLR", "params": {**_WARMUP, "warmup_num_steps": 1}},
}


# Blocks are DictConfig: `OmegaConf.resolve` (`--cfg job --resolve`) cannot store a plain dict in a value node.
def deepspeed_optimizer(owner: object, name: object) -> DictConfig | None:
    """The optimizer entry's "optimizer" block when DeepSpeed builds it."""
    entry = OPTIMIZERS.get(str(name))
    if plain(owner) != "deepspeed" or entry is None or entry.deepspeed_type is None:
        return None
    return OmegaConf.create(entry.deepspeed_block())


def deepspeed_scheduler(owner: object, name: object) -> DictConfig | None:
    block = DEEPSPEED_SCHEDULERS.get(plain(name))  # an unsupported name is reported by validate()
    return OmegaConf.create(block) if block is not None and plain(owner) == "deepspeed" else None


def sequence_parallel_key(size: object) -> int | None:
    """DeepSpeed's top-level `sequence_parallel_size`, only when on: its batch check divides the world size by it."""
    return int(size) if isinstance(size, int) and size > 1 else None


# keys of the session, not of the search: a study re-run with them is the same study
_SESSION_KEYS = ("resume", "dry_run")


def study_name(experiment_name: object, *, _root_: DictConfig) -> str:
    """hydra.sweeper.study_name by default, e.g. `default-lr-3f2a9c` (the experiment, the searched keys, a digest of the
    search): the same command continues its study. Kept in the resolver cache, which Hydra copies into every job's
    config; OmegaConf's use_cache does not take resolvers that read _root_."""
    cache = OmegaConf.get_cache(_root_).setdefault("ds_exp.study_name", {})
    if str(experiment_name) not in cache:
        cache[str(experiment_name)] = _study_name(str(experiment_name), _root_.hydra)
    return str(cache[str(experiment_name)])


def _study_name(experiment_name: str, hydra: DictConfig) -> str:
    params = OmegaConf.select(hydra, "sweeper.params", default=None) or {}
    typed = [str(o) for o in hydra.overrides.task] + [f"{k}={v}" for k, v in params.items()]
    searched: list[tuple[str, str]] = []
    fixed: list[tuple[str, str]] = []
    for override in OverridesParser.create().parse_overrides(typed):
        key = override.get_key_element().lstrip("+~")
        if key in _SESSION_KEYS:
            continue
        (searched if override.is_sweep_override() else fixed).append((key, str(override.input_line)))
    objective = OmegaConf.select(hydra, "sweeper.objective", default=None)
    direction = OmegaConf.select(hydra, "sweeper.direction", default=None)
    search = {"searched": sorted(searched), "fixed": sorted(fixed), "objective": objective, "direction": direction}
    digest = hashlib.sha256(json_text(search, sort_keys=True).encode()).hexdigest()[:6]
    keys = sorted({key.rpartition(".")[2] for key, _ in searched})
    return "-".join([experiment_name, *keys, digest])


def register_resolvers() -> None:
    resolvers: dict[str, Callable[..., DictConfig | int | str | None]] = {
        "ds_exp.deepspeed_optimizer": deepspeed_optimizer,
        "ds_exp.deepspeed_scheduler": deepspeed_scheduler,
        "ds_exp.sequence_parallel_key": sequence_parallel_key,
        "ds_exp.study_name": study_name,
    }
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
