"""The DeepSpeed config: groups + optional user JSON, with "auto" filled (Hugging Face's convention).

Precedence, in one place:
1. `deepspeed.config` (built from the groups by interpolation in conf/config.yaml) is the base.
2. `deepspeed.config_file`, when given, is merged over it key by key: the file wins for every key that is
   DeepSpeed's alone (ZeRO stage and buckets, offload, monitors, ...), and its `optimizer` / `scheduler`
   blocks make DeepSpeed own those.
3. Keys that mirror a ds_exp setting (batch sizes, clipping, optimizer and scheduler values, precision) must
   be "auto" or agree with that setting. Every disagreement is reported at once, suggesting "auto".
4. "auto" is filled from ds_exp's settings and from what only the run knows (world size, the model's hidden
   size, total steps). Config validation passes `partial=True`: the run-time ones stay "auto" there.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_exp.config.batch import data_parallel_size, global_batch_mismatch, global_batch_size
from ds_exp.config.optimizers import entry_for_deepspeed_type, entry_of
from ds_exp.config.resolvers import AUTO
from ds_exp.config.schema import Config, TrainConfig, plain
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
    """Optimizer steps between metric lines (DeepSpeed's steps_per_print): train.log_every when set, else the run's
    steps / LOG_POINTS (every step of a run of up to 50 steps, every 5th of the default 250)."""
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


def delete_path(tree: dict[str, Any], path: str) -> None:
    *parents, leaf = path.split(".")
    node = tree
    for part in parents:
        node = node[part]
    node.pop(leaf, None)


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


def replaced_by_config_file(cfg: Config, facts: RunFacts) -> list[str]:
    """One line for each of ds_exp's own settings that a user's DeepSpeed file replaces: an "optimizer" block
    (DeepSpeed builds that optimizer) and a "scheduler" block (its schedule, not scheduler.name's)."""
    if not cfg.deepspeed.config_file:
        return []
    file = load_config_file(cfg.deepspeed.config_file)
    key = f"deepspeed.config_file={cfg.deepspeed.config_file}"
    notes = []
    if isinstance(file.get("optimizer"), dict):
        notes.append(
            f"{key} brings its own optimizer ({file['optimizer'].get('type')}): DeepSpeed builds it, not ds_exp's "
            f"optimizer={cfg.optimizer.name}{_impl_of(cfg)}; remove the block to use ds_exp's"
        )
    if isinstance(file.get("scheduler"), dict):
        warmup = _effective_warmup(cfg, facts.total_steps)
        notes.append(
            f"{key} brings its own scheduler ({file['scheduler'].get('type')}): it replaces ds_exp's "
            f"{plain(cfg.scheduler.name)} schedule; its warmup comes from scheduler.warmup_steps / warmup_ratio "
            f"({max(warmup or 0, 1)} steps); remove the block to use ds_exp's schedule"
        )
    return notes


def _impl_of(cfg: Config) -> str:
    impl = getattr(cfg.optimizer, "impl", None)
    return "" if impl is None else f" (optimizer.impl={plain(impl)})"


def groups_ds_config(cfg: Config) -> dict[str, Any]:
    """The DeepSpeed config as composed from the groups (resolved by to_config), nulls dropped."""
    return strip_none(copy.deepcopy(cfg.deepspeed.config))


def merged_ds_config(cfg: Config) -> dict[str, Any]:
    """Groups, then the user's file over them (steps 1-2 of the module docstring); nothing filled yet."""
    base = groups_ds_config(cfg)
    if cfg.deepspeed.config_file:
        return deep_merge(base, load_config_file(cfg.deepspeed.config_file))
    return base


def _effective_warmup(cfg: Config, total_steps: int | None) -> int | None:
    sched = cfg.scheduler
    if sched.warmup_steps > 0:
        return int(sched.warmup_steps)
    if sched.warmup_ratio > 0:
        return None if total_steps is None else math.ceil(total_steps * sched.warmup_ratio)
    return 0


def expected_values(cfg: Config, facts: RunFacts) -> list[Expectation]:
    """Keys that mirror a ds_exp setting (Hugging Face's "auto" table): "auto" is filled with them, anything else
    must agree."""
    train, opt, sched = cfg.train, cfg.optimizer, cfg.scheduler
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
    sp = int(cfg.dist.sequence_parallel_size)
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
    warmup = _effective_warmup(cfg, facts.total_steps)
    if warmup is not None:
        # DeepSpeed's schedulers reject 0 warmup steps; one step from warmup_min_lr is the nearest they allow
        out.append(
            Expectation("scheduler.params.warmup_num_steps", max(warmup, 1), "scheduler.warmup_steps / warmup_ratio")
        )
    return out


def hidden_size_values(hidden_size: int) -> dict[str, int]:
    """Fill-only keys (Hugging Face's rules from the hidden size): explicit values are the user's tuning, never a
    mismatch."""
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


def optimizer_needs(cfg: Config, ds: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    """The DeepSpeed keys the optimizer needs at the config's ZeRO stage (its entry's deepspeed_settings):
    (path, needed value, the value set or MISSING, why). The optimizer DeepSpeed builds from a user's "optimizer"
    block is its type's entry, not optimizer.name's."""
    block = ds.get("optimizer")
    entry = entry_for_deepspeed_type(block.get("type")) if isinstance(block, dict) else entry_of(cfg.optimizer)
    if entry is None:
        return []
    stage = get_path(ds, "zero_optimization.stage")
    return [(path, value, get_path(ds, path), why) for path, (value, why) in entry.deepspeed_settings(stage).items()]


def _fill_optimizer_needs(cfg: Config, ds: dict[str, Any]) -> None:
    """Set what the optimizer needs where nothing set it (a value set otherwise is validation's to refuse)."""
    for path, value, current, _ in optimizer_needs(cfg, ds):
        if current is MISSING or current is None or current == AUTO:
            if "." in path:
                ds.setdefault(path.split(".", 1)[0], {})
            set_path(ds, path, value)


def resolve_ds_config(cfg: Config, facts: RunFacts, *, partial: bool = False) -> dict[str, Any]:
    """Merge, check and fill. Unless `partial` (validation, before the run knows its facts), the result has
    no "auto" left, or a ConfigError names the keys."""
    ds = merged_ds_config(cfg)

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
    for exp in expected_values(cfg, facts):
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
    _fill_optimizer_needs(cfg, ds)
    if stage is not MISSING and stage != 3:
        # stage-3 knobs mean nothing below stage 3; drop the ones still waiting to be filled
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            if get_path(ds, f"zero_optimization.{key}") == AUTO:
                delete_path(ds, f"zero_optimization.{key}")
    if facts.hidden_size is not None:
        for path, value in hidden_size_values(facts.hidden_size).items():
            if get_path(ds, path) == AUTO:
                set_path(ds, path, value)

    if facts.world_size is not None and get_path(ds, "zero_optimization.overlap_comm") == AUTO:
        # overlapping the reduction with the backward pass only pays where there is communication to hide; alone,
        # its side stream and buffers are pure cost (an H100 probe, 1 GPU, ZeRO-2: 266 ms a step with it, 206 without)
        set_path(ds, "zero_optimization.overlap_comm", facts.world_size > 1)

    if get_path(ds, "steps_per_print") == AUTO and facts.total_steps is not None:  # a file's own value is cosmetic
        set_path(ds, "steps_per_print", log_interval(cfg.train, facts.total_steps))

    if get_path(ds, "csv_monitor.output_path") == AUTO and facts.run_dir is not None:
        set_path(ds, "csv_monitor.output_path", str(Path(facts.run_dir) / "ds_monitor"))

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
