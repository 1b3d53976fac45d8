"""The numbers of the config (issue 31 §2): every number finite and within 64 bits, and every numeric key of the
schema within the range declared for it here, in one table (RANGES) beside the schema. tests/unit/test_hostile_inputs.py
walks the schema: a numeric key without a range, or a free-form (Any) key without a named check (FREE_FORM), fails it,
so a key added later is covered from the day it is added. Light: no torch, no deepspeed."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from ds_exp.config.schema import Config

INT64_MAX = 2**63 - 1  # torch, numpy and DeepSpeed's JSON take integers as 64-bit: a larger one overflows there
SEED_MAX = 2**32 - 1  # numpy's seeds (np.random.seed) are 32-bit, the narrowest library a seed reaches
MAX_TOKENS = 2**31 - 1  # tokens of a row: more than any model has positions
MAX_SYNTHETIC_ROWS = 10_000_000  # the embedded task is generated in this process, row by row
MAX_TIMEOUT_MINUTES = 525_600  # a year: torch's deadline (now + timeout, in nanoseconds) overflows near 1.5e8


@dataclass(frozen=True)
class Range:
    """Where a number may lie: [low, high], either end open or absent. `fix` follows the range in the message."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    fix: str = ""

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def said(self) -> str:
        if self.high is None:
            return f"must be {'>' if self.low_open else '>='} {_number(self.low)}"
        if self.low is None:
            return f"must be {'<' if self.high_open else '<='} {_number(self.high)}"
        if not (self.low_open or self.high_open) and float(self.high).is_integer() and float(self.low).is_integer():
            return f"must be from {_number(self.low)} to {_number(self.high)}"
        return (
            f"must be in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
            f"{')' if self.high_open else ']'}"
        )

    def problem(self, key: str, value: object) -> str | None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return None  # a type Hydra refused, or a non-finite number (said by number_problems)
        if self.holds(value):
            return None
        return f"{key}={value}: {self.said()}{self.fix}"


def _number(value: float | None) -> str:
    return str(int(value)) if value is not None and float(value).is_integer() else str(value)


def at_least(low: float, fix: str = "") -> Range:
    return Range(low=low, fix=fix)


def above(low: float, fix: str = "") -> Range:
    return Range(low=low, low_open=True, fix=fix)


@dataclass(frozen=True)
class Spec:
    """A value of a free-form mapping (scheduler.kwargs, model.rope_scaling): a whole number or a number in its
    range, or one of `choices`; with `each`, a non-empty list of such numbers."""

    whole: bool = False
    range: Range | None = None
    choices: tuple[object, ...] = ()
    null: bool = False  # null allowed (the library's own default)
    auto: bool = False  # `auto`: ds_exp decides
    each: bool = False

    def problem(self, value: object) -> str | None:
        """What is wrong with `value` (said after `KEY=VALUE: `), or None."""
        if (value is None and self.null) or (value == "auto" and self.auto):
            return None
        if self.choices:
            return None if value in self.choices else f"give one of {', '.join(map(_word, self.choices))}"
        if self.each:
            items = value if isinstance(value, (list, tuple)) else []
            problems = [self._number_problem(item) for item in items] or ["give a non-empty list of numbers"]
            found = next((p for p in problems if p is not None), None)
            return None if found is None else f"each item: {found}" if items else found
        return self._number_problem(value)

    def _number_problem(self, value: object) -> str | None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or (self.whole and isinstance(value, float)):
            kind = "a whole number" if self.whole else "a number"
            return f"give {kind}{', auto' if self.auto else ''}{' or null' if self.null else ''}"
        if not math.isfinite(value):
            return "must be a finite number"
        if self.range is not None and not self.range.holds(value):
            return f"{self.range.said()}{self.range.fix}"
        return None


def _word(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


FRACTION = Range(0, 1, high_open=True)  # [0, 1)
SEED = Range(0, SEED_MAX)

# Every int and float key of ds_exp/config/schema.py (list items: each item). Messages name the key, the range and
# what the value means at its ends; keys whose checks say more (combinations, what the key is for) keep those words
# in ds_exp/config/validate.py and friends, and the range here is then not said twice.
RANGES: dict[str, Range] = {
    "model.vocab_multiple": Range(1, 65536, fix=" (1 = no padding; the embedding is padded to a multiple of it)"),
    "model.tiled_mlp_shards": at_least(1, ", or null to derive it"),
    "model.tiled_loss_tokens": at_least(1, ", or null to derive it"),
    "data.synthetic.num_train": Range(1, MAX_SYNTHETIC_ROWS, fix=" (for more, train on your own data: data=local)"),
    "data.synthetic.num_eval": Range(0, MAX_SYNTHETIC_ROWS, fix=" (0 = no eval set)"),
    "data.synthetic.seed": SEED,
    "data.eval_fraction": Range(0, 1, high_open=True, fix=", e.g. 0.05"),
    "data.max_seq_len": Range(1, MAX_TOKENS, fix=", e.g. 512"),
    "data.num_proc": Range(1, 1024, fix=", or null to decide from the data size"),
    "data.max_eval_examples": at_least(1, ", or null for all"),
    "zero.stage": Range(0, 3, fix=" (zero=stage0 ... zero=stage3)"),
    "precision.loss_scale": at_least(0, " (0 = dynamic loss scaling)"),
    "precision.initial_scale_power": Range(0, 64, fix=" (dynamic loss scaling starts at 2^this; DeepSpeed's is 16)"),
    "precision.loss_scale_window": at_least(1),
    "precision.hysteresis": at_least(1),
    "precision.min_loss_scale": above(0),
    "lora.dim": at_least(0, " (0 turns LoRA off, e.g. lora.dim=64 turns it on)"),
    "lora.alpha": above(0, ", or null for alpha = dim"),
    "lora.dropout": FRACTION,
    "optimizer.lr": above(0),
    "optimizer.betas": FRACTION,
    "optimizer.eps": above(0),
    "optimizer.weight_decay": at_least(0),
    # each optimizer's own settings (ds_exp/config/optimizer_settings.py): a key only the chosen one has is checked
    "optimizer.momentum": FRACTION,
    "optimizer.adam_lr": above(0),
    "optimizer.beta2_decay": Range(None, 0, fix=" (torch's Adafactor default: -0.8)"),
    "optimizer.eps_scale": at_least(0),
    "optimizer.d": at_least(1, " (the clipping threshold of the update's RMS; torch's default 1.0)"),
    "scheduler.warmup_steps": at_least(0),
    "scheduler.warmup_ratio": FRACTION,
    "train.micro_batch_size": at_least(1),
    "train.eval_micro_batch_size": at_least(1, " or null"),
    "train.gradient_accumulation_steps": at_least(1),
    "train.epochs": at_least(1),
    "train.max_steps": at_least(-1, " (-1 = use train.epochs)"),
    "train.gradient_clipping": at_least(0, " (0 = no clipping)"),
    "train.seed": SEED,
    "train.log_every": at_least(1),
    "train.eval_every": at_least(0),
    "train.max_evals": at_least(1),
    "train.save_every": at_least(0),
    "train.keep_last": at_least(0),
    "train.export_every": at_least(0),
    "train.export_keep_last": at_least(0),
    "train.max_bad_steps": at_least(0),
    "train.peak_tflops": above(0, ", or null for the GPU's own"),
    "eval.max_new_tokens": Range(1, MAX_TOKENS),
    "eval.temperature": at_least(0, " (0 = greedy, e.g. 0.7 to sample)"),
    "eval.top_p": Range(0, 1, low_open=True, fix=" (1 = off)"),
    "eval.top_k": at_least(0, " (0 = off)"),
    "eval.seed": SEED,
    "eval.harness.limit": above(0, " (questions per task; a fraction when < 1), or null for all"),
    "eval.harness.num_fewshot": at_least(0, ", or null for each task's own"),
    "eval.harness.batch_size": at_least(1),
    "eval.harness.passkey_lengths": Range(64, MAX_TOKENS, fix=" tokens"),
    "dist.timeout_minutes": Range(1, MAX_TIMEOUT_MINUTES, fix=" (a year; the default is 30)"),
    "dist.master_port": Range(1, 65535, fix=" (a TCP port, e.g. 29500)"),
    "dist.sequence_parallel_size": at_least(1, " (1 = off)"),
}

# The free-form keys of the schema (typed Any, or a dict of anything) and the check that reads each before anything
# heavy runs. DeepSpeed's own schema reads the zero.* values again before the model is built
# (ds_exp.model.engine.check_deepspeed_config).
FREE_FORM: dict[str, str] = {
    "model.arch": "ds_exp.config.model_checks.arch_problems",
    "model.rope_scaling": "ds_exp.config.long_context.rope_scaling_problems",
    "lora.target_modules": "ds_exp.config.lora_checks",
    "scheduler.kwargs": "ds_exp.config.schedule_kwargs.scheduler_kwargs_problems",
    "train.global_batch_size": "ds_exp.config.validate (a positive integer or auto)",
    "logger.mlflow.tags": "ds_exp.config.trackers (MLflow's tags: text values)",
    "deepspeed.config": "ds_exp.config.ds_config (built from the groups; a user's file is DeepSpeed's to read)",
    "zero.overlap_comm": "zero_value_problems below: true, false or auto",
    **{  # the fast path's knobs (ds_exp/config/fast_path.py)
        key: "ds_exp.config.fast_path.fast_path_problems (auto, true or false)"
        for key in ("model.liger_kernel", "model.fused_loss", "train.compile")
    },
    "data.data_split": "ds_exp.data.checks (ds_exp.data.splits.parse_data_split: any spelling of three numbers)",
    **{
        f"zero.{key}": "zero_value_problems below: a whole number >= 0, or auto"
        for key in (
            "reduce_bucket_size",
            "allgather_bucket_size",
            "sub_group_size",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        )
    },
}
_ZERO_SIZES = tuple(key.removeprefix("zero.") for key, check in FREE_FORM.items() if "whole number" in check)
_SKIPPED = ("model.arch", "deepspeed")  # model.arch: checked with the architecture; a DeepSpeed file: DeepSpeed's


def number_problems(cfg: Config) -> list[tuple[str, str]]:
    """(key, line) for every number of the config that is not finite, or an integer beyond 64 bits: nan and inf
    parse as floats and nothing in a run means either, and torch, numpy and DeepSpeed overflow past 64 bits."""
    problems: list[tuple[str, str]] = []

    def walk(value: object, key: str) -> None:
        if key in _SKIPPED:
            return
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        elif isinstance(value, (list, tuple)):
            if any(_non_finite(v) for v in value):
                problems.append((key, f"{key}={list(value)}: every number must be finite"))
            elif any(_beyond_64_bits(v) for v in value):
                problems.append((key, f"{key}={list(value)}: every number must be within 64 bits (|n| <= 2^63 - 1)"))
        elif _non_finite(value):
            problems.append((key, f"{key}={value}: must be a finite number"))
        elif _beyond_64_bits(value):
            problems.append((key, f"{key}={value}: too large; whole numbers go up to 2^63 - 1 ({INT64_MAX})"))

    walk(cfg, "")
    return problems


def _non_finite(value: object) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _beyond_64_bits(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX


def lookup(cfg: Config, key: str) -> Any:
    """The value of a dotted key; None where the config has no such key (a setting of another optimizer)."""
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part, None)
    return value


def range_problems(cfg: Config) -> list[tuple[str, str]]:
    """(key, line) for every declared key whose value lies outside its range (None: a null the key allows)."""
    problems: list[tuple[str, str]] = []
    for key, allowed in RANGES.items():
        value = lookup(cfg, key)
        items = value if isinstance(value, (list, tuple)) else [value]
        bad = [problem for item in items if item is not None and (problem := allowed.problem(key, item))]
        if bad and isinstance(value, (list, tuple)):
            problems.append((key, f"{key}={list(value)}: each {allowed.said().removeprefix('must be ')}"))
        elif bad:
            problems.append((key, bad[0]))
    return problems + zero_value_problems(cfg)


def zero_value_problems(cfg: Config) -> list[tuple[str, str]]:
    """The zero.* values the schema types Any (a number or auto): what DeepSpeed's schema would refuse later."""
    zero = cfg.zero
    problems: list[tuple[str, str]] = []
    overlap = zero.overlap_comm
    if overlap is not None and overlap not in (True, False, "auto"):
        problems.append(("zero.overlap_comm", f"zero.overlap_comm={overlap}: give true, false or auto"))
    for name in _ZERO_SIZES:
        value = getattr(zero, name)
        if value is None or value == "auto" or _whole_at_least_zero(value):
            continue
        problems.append((f"zero.{name}", f"zero.{name}={value}: give a whole number >= 0 (e.g. 5e8), or auto"))
    return problems


def _whole_at_least_zero(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return float(value).is_integer() and 0 <= value <= INT64_MAX


def key_of(line: str) -> str:
    """The key a problem line starts with (`train.seed=-1: ...` -> train.seed)."""
    match = re.match(r"[\w.\[\]-]*", line)
    return match.group() if match else ""


def said_already(key: str, problems: list[str]) -> bool:
    """A line about `key` is among `problems` (each line starts with the key, then `=`, ` ` or `:`)."""
    return any(line.startswith((f"{key}=", f"{key} ", f"{key}:", f"{key}[")) for line in problems)


def numbers_problems(cfg: Config, said: list[str]) -> list[str]:
    """Every line of number_problems and range_problems whose key the other checks (`said`) have not named: a
    key's own check says more than its range."""
    lines: list[str] = []
    for key, line in number_problems(cfg) + range_problems(cfg):
        if not said_already(key, said + lines):
            lines.append(line)
    return lines
