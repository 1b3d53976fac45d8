"""The DeepSpeed config: `deepspeed.config` (from the groups in conf/config.yaml) with `deepspeed.config_file` merged
over it key by key, "auto" filled (Hugging Face's convention). The file wins for DeepSpeed's own keys, and its
`optimizer` / `scheduler` blocks make DeepSpeed own those; keys that mirror a ds_exp setting must be "auto" or agree
with it (every disagreement reported at once), and an explicit override the file would silently win over is refused
(`check_overrides_obeyed`)."""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from ds_exp.config.batch import data_parallel_size, global_batch_mismatch, global_batch_size
from ds_exp.config.optimizer_settings import OptimizerConfig
from ds_exp.config.optimizers import entry_for_deepspeed_type, entry_of
from ds_exp.config.paths import conf_dir
from ds_exp.config.resolvers import AUTO
from ds_exp.config.schema import Config, DeepSpeedSection, SchedulerConfig, TrainConfig, plain
from ds_exp.core.errors import ConfigError
from ds_exp.core.user_paths import special_file_problem

MISSING = object()
ZERO_STAGES = (0, 1, 2, 3)


def is_zero_stage(value: object) -> bool:
    """A ZeRO stage DeepSpeed has (a whole number 0-3; not a bool, which Python counts as 0 or 1)."""
    return type(value) is int and value in ZERO_STAGES


@dataclass(frozen=True)
class RunFacts:
    """What only the run knows. Any field may be None when it is not known yet."""

    world_size: int | None = None
    hidden_size: int | None = None
    total_steps: int | None = None
    warmup_steps: int | None = None
    precision: str | None = None  # fp32 | fp16 | bf16, after "auto" was decided
    run_dir: str | None = None
    sequence_parallel_size: int = 1  # dist.sequence_parallel_size: the batch counts world_size / it ranks

    @property
    def data_parallel_size(self) -> int | None:
        return None if self.world_size is None else data_parallel_size(self.world_size, self.sequence_parallel_size)


@dataclass(frozen=True)
class Expectation:
    path: str
    value: object
    source: str  # the ds_exp setting it comes from, for messages


LOG_POINTS = 50  # metric lines a run writes unless train.log_every says otherwise: a curve, even of 10 steps


def log_interval(train: TrainConfig, total_steps: int) -> int:
    """Optimizer steps between metric lines (and DeepSpeed's steps_per_print): train.log_every, else ~LOG_POINTS."""
    return int(train.log_every) or max(1, round(total_steps / LOG_POINTS))


def strip_none(value: object) -> Any:
    """Drop null keys (recursively): a null group knob means "DeepSpeed's default"."""
    if isinstance(value, dict):
        return {k: strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_none(v) for v in value]
    return value


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def get_path(tree: dict[str, Any], path: str, default: object = MISSING) -> Any:
    node: object = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def set_path(tree: dict[str, Any], path: str, value: object) -> None:
    *parents, leaf = path.split(".")
    node = tree
    for part in parents:
        node = node[part]
    node[leaf] = value


def load_config_file(path: str) -> dict[str, Any]:
    file = Path(path).expanduser()
    key = f"deepspeed.config_file={path}"
    if (special := special_file_problem("deepspeed.config_file", file)) is not None:
        raise ConfigError(special)
    if not file.is_file():
        raise ConfigError(f"{key}: file not found; give the path of an existing DeepSpeed JSON config")
    try:
        loaded = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{key} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); fix the file"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key} is not a text file; give a DeepSpeed JSON config") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{key}: the top level must be a JSON object, got {type(loaded).__name__}")
    return loaded


def replaced_by_config_file(
    file_name: str | None, opt: OptimizerConfig, sched: SchedulerConfig, total_steps: int | None
) -> list[str]:
    """One line for each of ds_exp's settings that deepspeed.config_file's "optimizer" or "scheduler" block replaces."""
    if not file_name:
        return []
    file = load_config_file(file_name)
    key = f"deepspeed.config_file={file_name}"
    notes = []
    if isinstance(file.get("optimizer"), dict):
        impl = getattr(opt, "impl", None)
        notes.append(
            f"{key} brings its own optimizer ({file['optimizer'].get('type')}): DeepSpeed builds it, not ds_exp's "
            f"optimizer={opt.name}{'' if impl is None else f' (optimizer.impl={plain(impl)})'}; remove the block to "
            "use ds_exp's"
        )
    if isinstance(file.get("scheduler"), dict):
        warmup = _effective_warmup(sched, total_steps)
        notes.append(
            f"{key} brings its own scheduler ({file['scheduler'].get('type')}): it replaces ds_exp's "
            f"{plain(sched.name)} schedule; its warmup comes from scheduler.warmup_steps / warmup_ratio "
            f"({max(warmup or 0, 1)} steps); remove the block to use ds_exp's schedule"
        )
    return notes


def groups_ds_config(section: DeepSpeedSection) -> dict[str, Any]:
    """The DeepSpeed config as composed from the groups (resolved by to_config), nulls dropped."""
    return strip_none(copy.deepcopy(section.config))


def merged_ds_config(section: DeepSpeedSection) -> dict[str, Any]:
    """Groups, then the user's file merged over them key by key; nothing filled yet."""
    base = groups_ds_config(section)
    if section.config_file:
        return deep_merge(base, load_config_file(section.config_file))
    return base


def _effective_warmup(sched: SchedulerConfig, total_steps: int | None) -> int | None:
    if sched.warmup_steps > 0:
        return int(sched.warmup_steps)
    if sched.warmup_ratio > 0:
        return None if total_steps is None else math.ceil(total_steps * sched.warmup_ratio)
    return 0


def expected_values(
    train: TrainConfig, opt: OptimizerConfig, sched: SchedulerConfig, facts: RunFacts
) -> list[Expectation]:
    """Keys that mirror a ds_exp setting (Hugging Face's "auto" table): "auto" is filled with them, else must agree."""
    out = [
        Expectation("train_micro_batch_size_per_gpu", train.micro_batch_size, "train.micro_batch_size"),
        Expectation(
            "gradient_accumulation_steps", train.gradient_accumulation_steps, "train.gradient_accumulation_steps"
        ),
        Expectation("gradient_clipping", float(train.gradient_clipping), "train.gradient_clipping"),
    ]
    entry = entry_of(opt)  # an unknown one is reported by validation
    for argument, (value, source) in (entry.values(opt) if entry else {}).items():
        out.append(Expectation(f"optimizer.params.{argument}", value, source))
    sp = facts.sequence_parallel_size
    # DeepSpeed reads it where it has no mpu (transformers' ZeRO-3 HfDeepSpeedConfig): its batch check divides by it
    out.append(Expectation("sequence_parallel_size", sp, "dist.sequence_parallel_size"))
    if facts.world_size is not None:
        data_parallel = data_parallel_size(facts.world_size, facts.sequence_parallel_size)
        ranks = f"world size {facts.world_size}" if sp == 1 else f"data-parallel size {data_parallel}"
        out.append(
            Expectation(
                "train_batch_size",
                global_batch_size(train, data_parallel),
                f"train.micro_batch_size x train.gradient_accumulation_steps x {ranks}",
            )
        )
    if facts.precision is not None:
        out.append(Expectation("fp16.enabled", facts.precision == "fp16", f"precision {facts.precision}"))
        out.append(Expectation("bf16.enabled", facts.precision == "bf16", f"precision {facts.precision}"))
    constant = plain(sched.name) == "constant"
    out.append(
        Expectation(
            "scheduler.params.warmup_min_lr",
            float(opt.lr) if constant else 0.0,
            "optimizer.lr (constant schedule)" if constant else "0 (warmup starts from zero)",
        )
    )
    out.append(Expectation("scheduler.params.warmup_max_lr", float(opt.lr), "optimizer.lr"))
    if facts.total_steps is not None:
        out.append(Expectation("scheduler.params.total_num_steps", facts.total_steps, "the computed training steps"))
    warmup = _effective_warmup(sched, facts.total_steps)
    if warmup is not None:
        # DeepSpeed's schedulers reject 0 warmup steps; one step from warmup_min_lr is the nearest they allow
        out.append(
            Expectation("scheduler.params.warmup_num_steps", max(warmup, 1), "scheduler.warmup_steps / warmup_ratio")
        )
    return out


def hidden_size_values(hidden_size: int) -> dict[str, int]:
    """Fill-only keys (Hugging Face's rules from the hidden size): explicit values are the user's tuning."""
    return {
        "zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
    }


def same_value(a: object, b: object) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        both_nan = math.isnan(a) and math.isnan(b)  # a nan setting is refused on its own, not as a mismatch
        return both_nan or math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def find_auto(tree: object, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in find_auto(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if tree == AUTO else []


def optimizer_needs(opt: OptimizerConfig, ds: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    """The DeepSpeed keys the optimizer needs at the ZeRO stage: (path, needed value, the value set or MISSING, why)."""
    block = ds.get("optimizer")
    entry = entry_for_deepspeed_type(block.get("type")) if isinstance(block, dict) else entry_of(opt)
    if entry is None:
        return []
    stage = get_path(ds, "zero_optimization.stage")
    return [(path, value, get_path(ds, path), why) for path, (value, why) in entry.deepspeed_settings(stage).items()]


def _fill_optimizer_needs(opt: OptimizerConfig, ds: dict[str, Any]) -> None:
    """Set what the optimizer needs where nothing set it (a value set otherwise is validation's to refuse)."""
    for path, value, current, _ in optimizer_needs(opt, ds):
        if current is MISSING or current is None or current == AUTO:
            if "." in path:
                ds.setdefault(path.split(".", 1)[0], {})
            set_path(ds, path, value)


def resolve_ds_config(cfg: Config, facts: RunFacts, *, partial: bool = False) -> dict[str, Any]:
    """Merge, check and fill; unless `partial` (validation), no "auto" is left, or a ConfigError names the keys."""
    ds = merged_ds_config(cfg.deepspeed)

    fp16_on, bf16_on = get_path(ds, "fp16.enabled"), get_path(ds, "bf16.enabled")
    if fp16_on is True and bf16_on is True:
        raise ConfigError(
            "fp16.enabled and bf16.enabled are both true in the DeepSpeed config: pick one "
            '(set both to "auto" and choose with precision=fp16 or precision=bf16)'
        )

    file_sets_batch = cfg.deepspeed.config_file and "train_batch_size" in load_config_file(cfg.deepspeed.config_file)
    if cfg.train.global_batch_size != AUTO and facts.world_size is not None and not file_sets_batch:
        sp = facts.sequence_parallel_size
        # ds_exp's own global batch, not a file's
        if cfg.train.global_batch_size != global_batch_size(cfg.train, data_parallel_size(facts.world_size, sp)):
            raise ConfigError(global_batch_mismatch(cfg.train, facts.world_size, sp))

    mismatches = []
    for exp in expected_values(cfg.train, cfg.optimizer, cfg.scheduler, facts):
        current = get_path(ds, exp.path)
        if current is MISSING:
            continue  # e.g. no scheduler block: nothing to fill
        if current == AUTO:
            set_path(ds, exp.path, exp.value)
        elif not same_value(current, exp.value):
            mismatches.append(
                f"- {exp.path}={json.dumps(current)} but ds_exp uses {json.dumps(exp.value)} (from {exp.source})"
            )
    if mismatches:
        raise ConfigError(
            [
                "the DeepSpeed config disagrees with ds_exp's settings:",
                *mismatches,
                'fix: set these keys to "auto" in the DeepSpeed config (ds_exp fills them), '
                "or change the ds_exp settings named above to match",
            ]
        )

    stage = get_path(ds, "zero_optimization.stage")
    _fill_optimizer_needs(cfg.optimizer, ds)
    if stage is not MISSING and stage != 3:
        # stage-3 knobs mean nothing below stage 3; drop the ones still waiting to be filled
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            if get_path(ds, f"zero_optimization.{key}") == AUTO:
                del ds["zero_optimization"][key]
    world, steps, run_dir = facts.world_size, facts.total_steps, facts.run_dir
    fills = {  # what only the run knows; None: not known yet (a file's own steps_per_print is cosmetic)
        **(hidden_size_values(facts.hidden_size) if facts.hidden_size is not None else {}),
        # overlap pays only where there is communication to hide (1 H100, ZeRO-2: 266 ms a step with it, 206 without)
        "zero_optimization.overlap_comm": None if world is None else world > 1,
        "steps_per_print": None if steps is None else log_interval(cfg.train, steps),
        "csv_monitor.output_path": None if run_dir is None else str(Path(run_dir) / "ds_monitor"),
    }
    for path, value in fills.items():
        if value is not None and get_path(ds, path) == AUTO:
            set_path(ds, path, value)

    if not partial:
        left = find_auto(ds)
        if left:
            needs_hidden = [p for p in left if p in hidden_size_values(1)]
            hint = (
                "the model config has no hidden_size to derive them from; set them to numbers "
                "(e.g. zero.reduce_bucket_size=500000000)"
                if needs_hidden and facts.hidden_size is None
                else "set them to explicit values"
            )
            raise ConfigError(f'"auto" could not be filled for {", ".join(left)}: {hint}')
    return ds


class IgnoredOverride(ConfigError):
    """An explicit override the run would not obey, because deepspeed.config_file replaces what it sets."""


_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")
# With its own "optimizer" block DeepSpeed builds the optimizer from the file; a hyperparameter the block leaves out
# is DeepSpeed's default ("auto" ones and weight_decay, which each parameter group carries, are obeyed)
_OPTIMIZER_BLOCK_REPLACES = ("optimizer", "optimizer.impl", "optimizer.name")


def _optimizer_params(opt: OptimizerConfig) -> dict[str, str]:
    """ds_exp's optimizer settings that reach DeepSpeed as a block's params: optimizer.<key> -> the param."""
    entry = entry_of(opt)
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
    """The ds_exp keys the groups' value at `path` interpolates (`${zero.stage}`), and deepspeed.config.<path>."""
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
    """Whether an override of `key` sets one of `sources` (a group's option: only where the file changes its pick)."""
    group_keys = _distinguishing_keys(key)
    if group_keys is not None:
        return any(source in group_keys for source in sources)
    return any(source == key or source.startswith(key + ".") for source in sources)


_GROUP_KEYS: dict[str, set[str] | None] = {}


def _distinguishing_keys(group: str) -> set[str] | None:
    """A conf/ group's keys that every option sets, to values not all the same (None for any other key)."""
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


def check_overrides_obeyed(composed: DictConfig, cfg: Config, overrides: list[str]) -> None:
    """IgnoredOverride naming each explicit override that deepspeed.config_file silently wins over: a DeepSpeed-only key
    the file sets otherwise, or ds_exp's optimizer / schedule choices where the file brings its own block. `composed`:
    the config before typing (its interpolations say which key feeds which)."""
    if not cfg.deepspeed.config_file or not overrides:
        return
    file = load_config_file(cfg.deepspeed.config_file)
    where = f"deepspeed.config_file={cfg.deepspeed.config_file}"
    unresolved = OmegaConf.to_container(composed.deepspeed.config, resolve=False)
    groups = groups_ds_config(cfg.deepspeed)
    facts = RunFacts(world_size=1, total_steps=1, warmup_steps=0, precision="fp32")
    # keys that mirror a ds_exp setting agree with it, or are an error already
    mirrored = {e.path for e in expected_values(cfg.train, cfg.optimizer, cfg.scheduler, facts)}
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
        why = _replacing_block(file, key, cfg.optimizer, cfg.scheduler)
        if why:
            problems.append(f"{override} would not be used: {where} {why}")
    if problems:
        raise IgnoredOverride(problems)


def _replacing_block(file: dict[str, Any], key: str, opt: OptimizerConfig, sched: SchedulerConfig) -> str | None:
    """Why the file's "optimizer" / "scheduler" block means `key` is not used, with the fix; or None."""
    for block, replaces, owner, params_of in (
        ("optimizer", _OPTIMIZER_BLOCK_REPLACES, opt.owner, _optimizer_params(opt)),
        ("scheduler", _SCHEDULER_BLOCK_REPLACES, sched.owner, dict.fromkeys(_SCHEDULER_WARMUP, "warmup_num_steps")),
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
