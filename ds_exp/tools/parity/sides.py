"""Both sides of a parity check, composed as `python -m ds_exp OVERRIDES` would (under each side's world size) and
compared before anything runs: parity means something only from the same weights and samples. No torch."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from ds_exp.config.batch import data_parallel_size, global_batch_size
from ds_exp.config.model_checks import model_settings
from ds_exp.config.override_checks import composition_problem
from ds_exp.config.paths import conf_dir
from ds_exp.config.resolvers import register_resolvers
from ds_exp.config.schema import Config, as_dict, register_configs, to_config
from ds_exp.config.secrets import hide_secret_overrides
from ds_exp.core.errors import ConfigError, DsExpError, first_line
from ds_exp.data.pipeline import prepare_sft_data
from ds_exp.launch.run_config import flat_keys
from ds_exp.launch.validation import validate
from ds_exp.model.tokenizer import load_tokenizer

# Keys parity sets on both sides, and why a side may not set them itself.
_METRIC_EVERY_STEP = "parity sets it: a metric line every step, no evaluation before or during training"
_NOTHING_KEPT = "parity sets it: no checkpoint, export or generations"
FORCED_KEYS = {
    "train.max_steps": "parity sets it from --steps N",
    "train.log_every": _METRIC_EVERY_STEP,
    "train.eval_at_start": _METRIC_EVERY_STEP,
    "train.eval_every": _METRIC_EVERY_STEP,
    "train.save_every": _NOTHING_KEPT,
    "train.save_final_checkpoint": _NOTHING_KEPT,
    "train.export": _NOTHING_KEPT,
    "train.export_every": _NOTHING_KEPT,
    "eval.prompts": _NOTHING_KEPT,
    "eval.prompts_file": _NOTHING_KEPT,
    "resume": "both sides start from the same fresh weights",
    "dry_run": "parity trains both sides",
    "hydra.run.dir": "parity puts each side's run directory under --out DIR",
    "hydra.sweep.dir": "parity runs one job per side",
}
# data.* keys that do not change what a step trains on
_DATA_KEYS_FREE = ("data.cache_dir", "data.num_proc")
# model.* keys that name the model itself (the others are ways of training it, which parity may compare)
_MODEL_KEYS = ("model.name_or_path", "model.arch", "model.tokenizer", "model.vocab_multiple")
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def forced_overrides(steps: int, run_dir: Path) -> list[str]:
    """What parity appends to each side's command line (last, so it wins over experiment presets)."""
    return [
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.eval_at_start=false",
        "train.eval_every=0",
        "train.save_every=0",
        "train.save_final_checkpoint=false",
        "train.export=false",
        "train.export_every=0",
        "eval.prompts=[]",
        "eval.prompts_file=null",
        "resume=null",
        "dry_run=false",
        f"hydra.run.dir={run_dir}",
    ]


@dataclass
class Side:
    name: str  # "A" or "B"
    overrides: list[str]  # as given, with secret values moved into `env` (ds_exp.config.secrets)
    ranks: int
    env: dict[str, str] = field(default_factory=dict)  # DS_EXP_SECRET_* values for the side's processes
    cfg: Config | None = None

    def shown(self, common: Sequence[str] = ()) -> str:
        """The side in words: its overrides (less those both sides share) and ranks."""
        overrides = " ".join(o for o in self.overrides if o not in common) or "(no other overrides)"
        return f"{overrides} ({self.ranks} rank{'s' if self.ranks > 1 else ''})"

    @property
    def sequence_parallel(self) -> int:
        assert self.cfg is not None
        return max(int(self.cfg.dist.sequence_parallel_size), 1)

    @property
    def data_parallel(self) -> int:
        """The side's ranks that draw different samples (a sequence-parallel group trains the same ones)."""
        return data_parallel_size(self.ranks, self.sequence_parallel)

    @property
    def global_batch(self) -> int:
        assert self.cfg is not None
        return global_batch_size(self.cfg.train, self.data_parallel)

    @property
    def batch_words(self) -> str:
        assert self.cfg is not None
        train = self.cfg.train
        ranks = f"{self.ranks} rank{'s' if self.ranks > 1 else ''}"
        if self.sequence_parallel > 1:
            n = self.sequence_parallel
            ranks = f"{self.data_parallel} data-parallel ({ranks} / dist.sequence_parallel_size={n})"
        return (
            f"micro {train.micro_batch_size} x accumulation {train.gradient_accumulation_steps} x {ranks} = "
            f"{self.global_batch}"
        )


def override_problems(side: Side) -> list[str]:
    """Flags, sweeps, overrides of the keys parity sets, and overrides Hydra cannot parse."""
    parser = OverridesParser.create()
    problems = []
    for arg in side.overrides:
        if arg.startswith("-"):
            problems.append(
                f"side {side.name}: {arg}: not a Hydra override; parity's own options go before `--` (side B's "
                "overrides follow it), and it runs one job per side (no -m, --cfg)"
            )
            continue
        try:
            (override,) = parser.parse_overrides([arg])
        except HydraException as err:
            problems.append(f"side {side.name}: {first_line(err)}")
            continue
        key = override.key_or_group
        if override.is_sweep_override():
            problems.append(
                f"side {side.name}: {arg} is a sweep; parity compares one run with one run: give one value per side"
            )
        elif key in FORCED_KEYS:
            problems.append(f"side {side.name}: {arg}: {FORCED_KEYS[key]}; drop it from the side's overrides")
    return problems


@contextmanager
def environ(set_to: dict[str, str], *, remove: Sequence[str] = ()) -> Iterator[None]:
    """os.environ with `remove` unset and `set_to` set while it lasts; every touched variable restored after."""
    touched = {*remove, *set_to}
    saved = {name: os.environ.get(name) for name in touched}
    for name in remove:
        os.environ.pop(name, None)
    os.environ.update(set_to)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launched_as(ranks: int) -> AbstractContextManager[None]:
    """Rank 0's launcher variables for `ranks` processes, while a side is validated (its world size counts)."""
    as_rank0 = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks)) if ranks > 1 else {}
    return environ(as_rank0, remove=_LAUNCH_VARS)


def compose_side(side: Side, forced: list[str]) -> list[str]:
    """Compose and validate the side as `python -m ds_exp` would; fills side.cfg. Returns the problems."""
    register_resolvers()
    register_configs()
    try:
        # the secrets' interpolations resolve as they will in the run
        with (
            environ(side.env),
            launched_as(side.ranks),
            initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"),
        ):
            side.cfg = to_config(compose(config_name="config", overrides=[*side.overrides, *forced]))
            validate(side.cfg)
    except DsExpError as err:
        return [f"side {side.name}: {line}" for line in str(err).splitlines()]
    except (HydraException, OmegaConfBaseException) as err:  # unknown key or option, wrong type
        return [f"side {side.name}: {composition_problem(err)}"]
    return []


def _differences(a: dict[str, Any], b: dict[str, Any], prefix: str) -> list[tuple[str, Any, Any]]:
    fa, fb = flat_keys(a, f"{prefix}."), flat_keys(b, f"{prefix}.")
    return [(key, fa.get(key), fb.get(key)) for key in sorted(set(fa) | set(fb)) if fa.get(key) != fb.get(key)]


def comparability_problems(a: Side, b: Side) -> list[str]:
    """Why the two sides' steps would not train the same model on the same samples; one line each."""
    assert a.cfg is not None and b.cfg is not None
    problems = []
    if a.global_batch != b.global_batch:
        problems.append(
            f"the global batch differs: A = {a.batch_words}, B = {b.batch_words}; every step must train on the same "
            f"samples: {_batch_fix(a, b)}"
        )
    if a.cfg.train.seed != b.cfg.train.seed:
        problems.append(
            f"train.seed differs (A {a.cfg.train.seed}, B {b.cfg.train.seed}): the initial weights and the data "
            "order come from it; give both sides the same train.seed"
        )
    da, db = as_dict(a.cfg), as_dict(b.cfg)
    for key, va, vb in _differences(da["model"], db["model"], "model"):
        if key.startswith(_MODEL_KEYS):
            problems.append(
                f"{key} differs (A {va}, B {vb}): parity compares two ways of training the same model; give both "
                "sides the same model"
            )
    for key, va, vb in _differences(da["lora"], db["lora"], "lora"):
        if key != "lora.dropout":  # which weights train, and how adapters scale them
            problems.append(
                f"{key} differs (A {va}, B {vb}): the two sides would train different weights; give both sides the "
                "same LoRA settings"
            )
    for key, va, vb in _differences(da["scheduler"], db["scheduler"], "scheduler"):
        if key != "scheduler.owner":  # who steps the schedule may differ, not its shape
            problems.append(
                f"{key} differs (A {va}, B {vb}): the learning rate schedule must be the same on both sides; give "
                "both sides the same scheduler settings"
            )
    for key, va, vb in _differences(da["data"], db["data"], "data"):
        if key == "data.packing":
            continue  # comparable when packing joins no two examples: packing_problems, once the data are built
        if not key.startswith(_DATA_KEYS_FREE):
            problems.append(
                f"{key} differs (A {va}, B {vb}): every step must train on the same tokens; give both sides the same "
                "data settings"
            )
    return problems


def packing_problems(a: Side, b: Side) -> list[str]:
    """Packing on one side only compares when it joined no two examples (told by building both train sets, cached)."""
    assert a.cfg is not None and b.cfg is not None
    if a.cfg.data.packing == b.cfg.data.packing:
        return []

    datasets.disable_progress_bars()  # the data pipeline's own notes (truncated, dropped) still print
    rows = {}
    for side in (a, b):
        assert side.cfg is not None
        tokenizer = load_tokenizer(side.cfg.model, side.cfg.data)
        rows[side.name] = prepare_sft_data(side.cfg.data, tokenizer, seed=side.cfg.train.seed).train
    packed, plain = (a, b) if a.cfg.data.packing else (b, a)
    if len(rows[packed.name]) == len(rows[plain.name]):
        return []
    shortest = min(len(ids) for ids in rows[plain.name]["input_ids"])
    return [
        f"data.packing differs (side {packed.name} packs): packing joined {len(rows[plain.name])} train examples "
        f"into {len(rows[packed.name])} rows, so the two sides' steps train on different examples and no step of "
        "one has a counterpart in the other. Parity can compare packing on and off only where it joins no two "
        f"examples: data.max_seq_len={2 * shortest - 1} or less on both sides (the shortest example has {shortest} "
        "tokens). To compare packing's effect on quality, compare full runs: python -m ds_exp -m "
        "data.packing=false,true (eval perplexity in the sweep report)"
    ]


def _batch_fix(a: Side, b: Side) -> str:
    """The accumulation that makes one side's global batch the other's, when there is one."""
    for fix, target in ((b, a), (a, b)):
        assert fix.cfg is not None
        per_step = fix.cfg.train.micro_batch_size * fix.data_parallel
        if target.global_batch % per_step == 0:
            return f"add train.gradient_accumulation_steps={target.global_batch // per_step} to side {fix.name}"
    return "make train.micro_batch_size x train.gradient_accumulation_steps x ranks equal on both sides"


def dropout_notes(a: Side, b: Side) -> list[str]:
    """Dropout masks differ per rank and micro batch: sides splitting the global batch differently differ in loss."""
    assert a.cfg is not None and b.cfg is not None
    split = (a.ranks, a.cfg.train.micro_batch_size), (b.ranks, b.cfg.train.micro_batch_size)
    if split[0] == split[1]:
        return []
    notes = []
    for side in (a, b):
        assert side.cfg is not None
        settings = model_settings(side.cfg.model) or {}
        dropouts = {
            k: v
            for k, v in settings.items()
            if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float) and v > 0
        }
        if dropouts and not side.cfg.model.disable_dropout:
            named = ", ".join(f"{k}={v}" for k, v in sorted(dropouts.items()))
            notes.append(
                f"side {side.name}: the model has dropout ({named}) and the sides split the batch differently, so "
                "their dropout masks differ: add model.disable_dropout=true to both sides for an exact comparison"
            )
        if side.cfg.lora.dim > 0 and side.cfg.lora.dropout > 0:
            notes.append(
                f"side {side.name}: lora.dropout={side.cfg.lora.dropout} draws different masks when the batch is "
                "split differently: set lora.dropout=0 on both sides for an exact comparison"
            )
    return notes


def hide_secrets(side: Side) -> None:
    """Secret values leave the overrides (and so parity.json and the side's .hydra/) for the side's environment."""
    try:
        side.overrides = hide_secret_overrides(side.overrides, side.env)
    except ConfigError as err:
        raise ConfigError([f"side {side.name}: {line}" for line in err.problems]) from None
