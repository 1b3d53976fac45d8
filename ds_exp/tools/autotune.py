"""`python -m ds_exp -m experiment=autotune`: which configuration fits and is fastest. Candidates are sorted before any
launch ("not applicable", "ruled out" by memory, or a short probe); a sweeper, since a callback cannot drop jobs."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn
from omegaconf import DictConfig, OmegaConf

from ds_exp.config.ds_config import IgnoredOverride, log_interval
from ds_exp.config.features import feature_hooks, feature_settings
from ds_exp.config.memory_plan import human_bytes, run_estimate
from ds_exp.config.plan import RunPlan, plan_run
from ds_exp.config.precision import detect_accelerator
from ds_exp.config.schema import Config, TrainConfig
from ds_exp.core import compat
from ds_exp.core.errors import ConfigError, DsExpError, first_line
from ds_exp.core.files import write_json_atomic
from ds_exp.launch.console import report_user_error
from ds_exp.launch.validation import validate_job
from ds_exp.model.architecture import model_facts
from ds_exp.runtime.device import resolved_precision
from ds_exp.sweeps.jobs import LaunchingSweeper, check_job
from ds_exp.sweeps.report import PLAN_FILE, WARMUP_STEPS
from ds_exp.train.hooks import RunHooks

_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def parse_budget(value: object) -> int | None:
    """hydra.sweeper.memory_budget: None for auto, else bytes ("80GiB", "512MiB", "1.5GB")."""
    text = str(value).strip().lower()
    if text in ("auto", "none", "null"):
        return None
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]i?b)", text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(
            f"hydra.sweeper.memory_budget={value}: expected auto or a positive size with its unit, e.g. 80GiB or 512MiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def fail(lines: Sequence[str]) -> NoReturn:
    """The sweep stops before anything is written or launched: one message, exit status 2."""
    report_user_error(ConfigError(list(lines)))
    sys.exit(2)


class Autotune(LaunchingSweeper):
    def __init__(
        self,
        memory_budget: object = "auto",
        probe_keys: Sequence[str] | None = None,
        params: dict[str, str] | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.memory_budget = memory_budget
        self.probe_keys = list(probe_keys or [])
        self.params = dict(params or {})
        self.max_batch_size = max_batch_size
        self._facts: dict[str, dict[str, int]] = {}
        self._examples: dict[str, int] = {}  # the training set's size, per data config (plan)
        self._refusals: list[str] = []  # settings that make the whole sweep pointless (judge collects them)
        self._composed: dict[tuple[str, ...], tuple[DictConfig, Config]] = {}  # each probe, for check_job

    def sweep(self, arguments: list[str]) -> list[Sequence[JobReturn]]:
        assert self.config is not None and self.hydra_context is not None and self.launcher is not None  # setup()
        grid = [f"{key}={value}" for key, value in self.params.items()] + list(arguments)
        parsed = OverridesParser.create().parse_overrides(grid)
        last = {o.get_key_element(): o.is_sweep_override() for o in parsed}  # the command line wins, as in Hydra
        swept = [key for key, is_sweep in last.items() if is_sweep]
        if not swept:
            fail(
                [
                    "experiment=autotune: the grid is empty: hydra.sweeper.params and the command line sweep nothing",
                    "give each dimension its values, e.g. zero=stage1,stage2,stage3 train.micro_batch_size=4,8,16 "
                    "(conf/experiment/autotune.yaml has the default grid)",
                ]
            )
        self.check_settings()
        try:
            budget = parse_budget(self.memory_budget)
        except ValueError as err:
            fail([str(err)])
        world, accelerator = self.world_size(), self.accelerator()
        if budget is None:
            budget, source = self.default_budget(accelerator)
        else:
            source = f"hydra.sweeper.memory_budget={self.memory_budget}"
        candidates = [self.judge(list(job), world, accelerator, budget) for job in compat.basic_sweep_jobs(grid)]
        if self._refusals:  # settings no probe would obey or could measure: the sweep would decide on nothing
            fail(["experiment=autotune: the probes would not measure what the grid says", *self._refusals])
        probes = [c for c in candidates if c["verdict"] == "probe"]
        if not probes:
            fail(self.nothing_to_probe(candidates, budget, source))

        problems = []
        for number, candidate in enumerate(probes):
            candidate["job"] = str(number)
            # its directory checked like a single run's (and recorded for the report) before anything is launched
            composed = self._composed.pop(tuple(candidate["overrides"]), None)  # as judge composed and validated it
            loader = self.hydra_context.config_loader
            problems += check_job(loader, self.config, candidate["overrides"], number, composed=composed)[1]
        if problems:
            fail(["experiment=autotune: the sweep was not started", *problems])

        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        plan = {
            "world_size": world,
            "accelerator": accelerator,
            "memory_budget_bytes": budget,
            "memory_budget_source": source,
            "swept": swept,
            "probe_keys": self.probe_keys,
            "launcher_overrides": self.launcher_overrides(),
            "candidates": candidates,
        }

        write_json_atomic(sweep_dir / PLAN_FILE, plan)

        counts = {v: sum(c["verdict"] == v for c in candidates) for v in ("probe", "ruled_out", "not_applicable")}
        print(
            f"ds_exp autotune: {len(candidates)} candidates at world size {world}, memory budget "
            f"{human_bytes(budget)} per rank ({source}): {counts['probe']} probed, {counts['ruled_out']} ruled out by "
            f"the memory estimate, {counts['not_applicable']} not applicable"
        )
        jobs = [c["overrides"] for c in probes]
        size = self.max_batch_size or len(jobs)  # check_settings: null or >= 1
        returns = []
        for start in range(0, len(jobs), size):
            # a failed probe (out of memory, a crash) is recorded in its summary.json, never fatal to the sweep
            returns.append(self.launcher.launch(jobs[start : start + size], initial_job_idx=start))
        return returns

    def judge(self, overrides: list[str], world: int, accelerator: str, budget: int) -> dict[str, Any]:
        """One candidate: not applicable (refused by validation), ruled out (estimate over budget) or a probe."""
        candidate: dict[str, Any] = {"overrides": overrides, "job": None, "reason": None, "estimate_bytes": None}
        assert self.config is not None and self.hydra_context is not None  # setup()
        try:
            composed = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            cfg = validate_job(composed, overrides)  # the one validation of every sweeper's jobs
        except IgnoredOverride as err:  # e.g. zero=stage1 under a DeepSpeed file that sets stage 3: not a result
            self._refusals += [line for line in err.problems if line not in self._refusals]  # once, not per job
            return {**candidate, "verdict": "not_applicable", "reason": first_line(err)}
        except DsExpError as err:
            return {**candidate, "verdict": "not_applicable", "reason": first_line(err)}
        except Exception as err:  # an unknown option or a wrong type: the user's typo, not a candidate to skip
            fail([f"experiment=autotune: job [{' '.join(overrides)}]: {first_line(err)}"])
        unmeasurable = self.cannot_measure(cfg.train)
        if unmeasurable and unmeasurable not in self._refusals:
            self._refusals.append(unmeasurable)
        if self._refusals:  # the sweep is refused: no need to estimate (which loads the model's config)
            return {**candidate, "verdict": "not_applicable", "reason": self._refusals[0]}
        # per rank as the dry run counts: model states plus a micro batch's activations (on a CPU, offloaded too)
        facts, precision = self.model_facts(cfg), resolved_precision(cfg.precision.dtype, accelerator)
        estimate = run_estimate(cfg, facts, world_size=world, precision=precision, accelerator=accelerator)
        candidate.update(estimate)
        if estimate["estimate_bytes"] > budget:
            candidate.update(
                verdict="ruled_out",
                reason=f"estimated {human_bytes(estimate['estimate_bytes'])} per rank > budget {human_bytes(budget)}",
            )
            return candidate
        try:  # last: it counts the training set
            self.plan(cfg, world, accelerator, Path(self.config.hydra.sweep.dir))
        except DsExpError as err:
            return {**candidate, "verdict": "not_applicable", "reason": first_line(err)}
        self._composed[tuple(overrides)] = composed, cfg
        return {**candidate, "verdict": "probe"}

    def check_settings(self) -> None:
        """The sweeper's own settings, before anything is composed: each one that cannot work is named."""
        problems = []
        size = self.max_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            problems.append(
                f"hydra.sweeper.max_batch_size={size}: the probes handed to the launcher at once; give a whole number "
                ">= 1, or null for all of them"
            )
        if problems:
            fail(problems)

    @staticmethod
    def cannot_measure(train: TrainConfig) -> str | None:
        """Why a probe would time nothing: its speed is the median of metric lines after the first (warm-up) one."""
        steps = int(train.max_steps)
        every = log_interval(train, steps)
        if steps == -1 or steps > max(every, WARMUP_STEPS):
            return None
        return (
            f"train.max_steps={steps} with train.log_every={every}: a probe's speed is timed on the metric lines after "
            f"its first {WARMUP_STEPS} warm-up step(s), and these probes would write none; give train.max_steps > "
            f"{max(every, WARMUP_STEPS)} (experiment=autotune uses 6 with train.log_every=1)"
        )

    def plan(self, cfg: Config, world: int, accelerator: str, sweep_dir: Path) -> RunPlan:
        """The probe's plan as its run makes it: what its setup would refuse is refused before anything is launched."""
        # here: datasets reserves ~1 GB of address space on import, none left for transformers under a ulimit
        from ds_exp.data.pipeline import count_train_examples

        key = repr(cfg.data)
        if key not in self._examples:
            self._examples[key] = count_train_examples(cfg.data)
        return plan_run(
            cfg,
            world_size=world,
            train_examples=self._examples[key],
            hidden_size=self.model_facts(cfg)["hidden"] or None,
            precision=resolved_precision(cfg.precision.dtype, accelerator),
            run_dir=sweep_dir,
        )

    def model_facts(self, cfg: Config) -> dict[str, int]:
        """Parameter counts and shapes, from the model's config on the meta device (no weights), once per model."""
        key = repr((cfg.model, cfg.lora, cfg.data.end_of_conversation_token, cfg.objective))  # every field shown
        if key not in self._facts:
            auto_class = RunHooks(feature_hooks(feature_settings(cfg))).objective().model_class  # a reward model's
            self._facts[key] = model_facts(cfg, auto_class)
        return self._facts[key]

    def launcher_config(self) -> DictConfig:
        assert self.config is not None  # setup()
        return self.config.hydra.launcher

    def is_submitit(self) -> bool:
        return "submitit" in str(self.launcher_config().get("_target_", ""))

    def world_size(self) -> int:
        """The ranks of each probe: a submitit job's tasks; one process with Hydra's basic launcher."""
        launcher = self.launcher_config()
        if not self.is_submitit():
            return 1
        return int(launcher.get("nodes") or 1) * int(launcher.get("tasks_per_node") or 1)

    def accelerator(self) -> str:
        gpus = self.launcher_config().get("gpus_per_node") if self.is_submitit() else None
        return "cuda" if gpus else detect_accelerator()

    def default_budget(self, accelerator: str) -> tuple[int, str]:
        """Each rank's memory: the GPU's; on a CPU mem_gb or what is free now, shared by a node's ranks."""
        launcher = self.launcher_config()
        per_node = int(launcher.get("tasks_per_node") or 1) if self.is_submitit() else 1
        if accelerator == "cuda":
            if not torch.cuda.is_available():
                fail(
                    [
                        "hydra.sweeper.memory_budget=auto cannot see the probes' GPUs from this machine",
                        "set it to what one GPU has, e.g. hydra.sweeper.memory_budget=80GiB",
                    ]
                )
            props = torch.cuda.get_device_properties(0)
            return int(props.total_memory), f"the memory of one {props.name}"
        mem_gb = launcher.get("mem_gb") if self.is_submitit() else None
        if mem_gb:
            return int(float(mem_gb) * 2**30 / per_node), f"hydra.launcher.mem_gb={mem_gb} / {per_node} rank(s)"
        import psutil

        available = psutil.virtual_memory().available
        return int(available / per_node), f"available RAM / {per_node} rank(s) per node"

    def launcher_overrides(self) -> list[str]:
        """The command line's launcher choices, kept in the recommended command when jobs go through submitit."""
        if not self.is_submitit():
            return []
        assert self.config is not None  # setup()
        given = list(self.config.hydra.overrides.hydra)
        return [o for o in given if o.startswith(("hydra/launcher=", "hydra.launcher."))]

    @staticmethod
    def nothing_to_probe(candidates: list[dict[str, Any]], budget: int, source: str) -> list[str]:
        ruled_out = [c for c in candidates if c["verdict"] == "ruled_out"]
        if not ruled_out:
            reasons = sorted({c["reason"] for c in candidates})
            return [
                f"experiment=autotune: none of the {len(candidates)} candidates is a valid configuration",
                *reasons[:5],
            ]
        smallest = min(ruled_out, key=lambda c: c["estimate_bytes"])
        return [
            f"experiment=autotune: nothing fits the memory budget of {human_bytes(budget)} per rank ({source})",
            f"the smallest candidate, [{' '.join(smallest['overrides'])}], needs an estimated "
            f"{human_bytes(smallest['estimate_bytes'])} per rank",
            "raise hydra.sweeper.memory_budget, or add candidates that need less: a smaller train.micro_batch_size, "
            "model.gradient_checkpointing=true, zero=stage3, offload=cpu_all, lora.dim=64",
        ]
