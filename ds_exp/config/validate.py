"""Semantic checks of a composed config: combinations, ranges and paths the typed schema cannot express.

Runs before anything heavy (no torch, no deepspeed): every problem found becomes one line naming the key
and the fix, all reported together in one ConfigError.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

from ds_exp.config.ds_config import RunFacts, get_path, load_config_file, resolve_ds_config
from ds_exp.config.logger_checks import logger_problems
from ds_exp.config.long_context_checks import long_context_problems
from ds_exp.config.lora_checks import lora_problems
from ds_exp.config.model_checks import (
    check_arch,
    check_checkpoint,
    check_max_new_tokens,
    check_max_seq_len,
    looks_like_local_path,
)
from ds_exp.config.optimizer_checks import placement_problems, settings_problems
from ds_exp.config.output_paths import check_output_paths
from ds_exp.config.paths import not_a_directory
from ds_exp.config.place_checks import experiment_name_problem
from ds_exp.config.plan import data_parallel_size, decay_problem, global_batch_mismatch, samples_per_rank
from ds_exp.config.precision import decide_precision, supports_bf16, supports_fp16
from ds_exp.config.resolvers import DEEPSPEED_SCHEDULERS
from ds_exp.config.sampling import sampling_problems
from ds_exp.config.schema import Config, plain
from ds_exp.config.sp_checks import check_sequence_parallel, zero_problems
from ds_exp.core.errors import ConfigError
from ds_exp.core.user_paths import special_file_problem

MAX_TIMEOUT_MINUTES = 525_600  # a year: torch's deadline (now + timeout, in nanoseconds) overflows near 1.5e8


def _check_model(cfg: Config) -> list[str]:
    problems = []
    model = cfg.model
    if model.name_or_path is None and model.arch is None:
        problems.append(
            "model.name_or_path is not set and the model has no `arch`: give model.name_or_path=<local dir or "
            "hub id> or pick a preset (model=tiny)"
        )
    for key in ("name_or_path", "tokenizer"):
        value = getattr(model, key)
        if value is None or not looks_like_local_path(value):
            continue
        path = Path(value).expanduser()
        if (special := special_file_problem(f"model.{key}", value)) is not None:
            problems.append(special)
        elif not path.exists():
            problems.append(f"model.{key}={value}: directory not found; give an existing local directory or a hub id")
        elif key == "name_or_path" and not (path / "config.json").is_file():
            problems.append(
                f"model.name_or_path={value} has no config.json: point it at a Hugging Face checkpoint directory"
            )
    if model.vocab_multiple < 1:
        problems.append(f"model.vocab_multiple={model.vocab_multiple}: must be >= 1 (1 = no padding)")
    return problems + check_arch(cfg) + check_checkpoint(cfg) + check_max_seq_len(cfg) + check_max_new_tokens(cfg)


def _check_speed_features(cfg: Config, accelerator: str) -> list[str]:
    """Features that need a package or a GPU: told here, not as an ImportError after the model is loaded."""
    problems = []
    attention = cfg.model.attn_implementation
    if attention in ("flash_attention_2", "flash_attention_3"):
        package = "flash_attn" if attention == "flash_attention_2" else "flash_attn_interface"
        if accelerator != "cuda":
            problems.append(
                f"model.attn_implementation={attention} needs a CUDA GPU (this is {accelerator}); use "
                "model.attn_implementation=auto (FlashAttention where usable, else transformers' default)"
            )
        elif importlib.util.find_spec(package) is None:
            problems.append(
                f"model.attn_implementation={attention}: the {package} package is not installed "
                "(pip install flash-attn --no-build-isolation); or use model.attn_implementation=auto"
            )
    if cfg.model.liger_kernel:
        if accelerator != "cuda":
            problems.append(
                f"model.liger_kernel=true: Liger's kernels are Triton GPU kernels and this is {accelerator}; "
                "set model.liger_kernel=false"
            )
        elif importlib.util.find_spec("liger_kernel") is None:
            problems.append("model.liger_kernel=true: pip install liger-kernel, or set model.liger_kernel=false")
    if cfg.train.peak_tflops is not None and cfg.train.peak_tflops <= 0:
        problems.append(f"train.peak_tflops={cfg.train.peak_tflops}: must be > 0, or null for the GPU's own")
    return problems


def _file_setting(cfg: Config, path: str) -> str | None:
    """The user's DeepSpeed file when it sets `path` (the file wins over the groups there), else None: messages
    then name the file and its key, not the group override that did not set the value."""
    file = cfg.deepspeed.config_file
    if not file:
        return None
    try:
        loaded = load_config_file(file)
    except ConfigError:
        return None  # reported on its own
    return file if get_path(loaded, path, _UNSET) is not _UNSET else None


_UNSET = object()


def _setting(cfg: Config, path: str, value: object, group_key: str) -> str:
    """How a message names where a DeepSpeed value came from: the file and its key, or the ds_exp setting."""
    shown = json.dumps(value) if isinstance(value, bool) else value  # as the override is written: true, not True
    return _in_file(path, value, _file_setting(cfg, path)) or f"{group_key}={shown}"


def _check_zero_and_offload(cfg: Config, ds: dict[str, Any]) -> list[str]:
    """ZeRO stage and offload fit together; a value from the user's DeepSpeed file is named with its file and key."""
    stage = get_path(ds, "zero_optimization.stage", None)
    stage_file = _file_setting(cfg, "zero_optimization.stage")
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        if stage_file is not None:
            return [
                f"{_in_file('zero_optimization.stage', stage, stage_file)}: ZeRO stage must be 0, 1, 2 or 3; fix it "
                "in the file (or remove it there and choose with zero=stage0 ... zero=stage3)"
            ]
        return [f"zero.stage={stage}: ZeRO stage must be 0, 1, 2 or 3 (zero=stage0 ... zero=stage3)"]
    problems = []
    devices = {
        kind: get_path(ds, f"zero_optimization.offload_{kind}.device", "none") for kind in ("param", "optimizer")
    }
    for kind, dev in devices.items():
        needs_stage3 = kind == "param"
        if dev not in ("cpu", "nvme") or stage in ((3,) if needs_stage3 else (1, 2, 3)):
            continue
        offload_file = _file_setting(cfg, f"zero_optimization.offload_{kind}.device")
        what = _in_file(f"zero_optimization.offload_{kind}.device", dev, offload_file) or f"offload.{kind}={dev}"
        same = stage_file is not None and stage_file == offload_file
        got = f"got stage {stage}"
        if same:
            got += ' from "zero_optimization.stage" in the same file'
        elif offload_file or stage_file:
            got += f" from {_in_file('zero_optimization.stage', stage, stage_file) or f'zero=stage{stage}'}"
        if stage_file:
            where = "there" if same else f"in {stage_file}"
            fix = f'set "zero_optimization.stage" to {"3" if needs_stage3 else "1, 2 or 3"} {where}'
        else:
            fix = "use zero=stage3" if needs_stage3 else "use zero=stage1 or higher"
        if offload_file:
            fix += f', or remove "offload_{kind}" from {"it" if same else offload_file}'
        elif needs_stage3:
            fix += ", or offload=cpu to offload only the optimizer"
        problems.append(f"{what} needs ZeRO {'stage 3' if needs_stage3 else 'stage 1, 2 or 3'} ({got}): {fix}")
    for kind in ("optimizer", "param"):
        if devices[kind] != "nvme":
            continue
        nvme_path = get_path(ds, f"zero_optimization.offload_{kind}.nvme_path", None)
        device_file = _file_setting(cfg, f"zero_optimization.offload_{kind}.device")
        if not nvme_path:
            problems.append(
                f"{_in_file(f'zero_optimization.offload_{kind}.device', 'nvme', device_file)} needs a directory: "
                f'add "nvme_path": "/path/on/local/nvme" beside it (or set offload.nvme_path)'
                if device_file
                else f"offload.{kind}=nvme needs a directory: set offload.nvme_path=/path/on/local/nvme"
            )
            continue
        # DeepSpeed's swapper makes its files under it: a file there fails deep in engine construction
        in_the_way = not_a_directory(Path(str(nvme_path)).expanduser())
        if in_the_way is None:
            continue
        where = "" if in_the_way == Path(str(nvme_path)).expanduser() else f": {in_the_way}"
        path_file = _file_setting(cfg, f"zero_optimization.offload_{kind}.nvme_path")
        problem = (
            f"{_in_file(f'zero_optimization.offload_{kind}.nvme_path', nvme_path, path_file)}{where} is a file, not "
            "a directory; point it at a directory on a local NVMe drive"
            if path_file
            else f"offload.nvme_path={nvme_path}{where} is a file, not a directory; point offload.nvme_path at a "
            "directory on a local NVMe drive"
        )
        if problem not in problems:  # optimizer and parameters share the path
            problems.append(problem)
    return problems


def _in_file(path: str, value: object, file: str | None) -> str:
    """A DeepSpeed key as it stands in the user's file ("" when the file does not set it)."""
    return f'"{path}": {json.dumps(value)} in deepspeed.config_file={file}' if file else ""


def _check_numbers(cfg: Config, world: int) -> list[str]:
    problems = []
    train, sched, lora = cfg.train, cfg.scheduler, cfg.lora
    if lora.dim < 0:
        problems.append(f"lora.dim={lora.dim}: must be >= 0 (0 turns LoRA off, e.g. lora.dim=64 turns it on)")
    if lora.dim > 0:
        if lora.alpha is not None and lora.alpha <= 0:
            problems.append(f"lora.alpha={lora.alpha}: must be > 0, or null for alpha = dim")
        if not 0 <= lora.dropout < 1:
            problems.append(f"lora.dropout={lora.dropout}: must be in [0, 1)")
    problems += settings_problems(cfg)  # the optimizer's own (its entry in ds_exp/config/optimizers.py)
    if sched.warmup_steps < 0:
        problems.append(f"scheduler.warmup_steps={sched.warmup_steps}: must be >= 0")
    if not 0 <= sched.warmup_ratio < 1:
        problems.append(f"scheduler.warmup_ratio={sched.warmup_ratio}: must be in [0, 1)")
    if sched.warmup_steps > 0 and sched.warmup_ratio > 0:
        problems.append("scheduler.warmup_steps and scheduler.warmup_ratio are both set: keep one, set the other to 0")
    if plain(sched.owner) == "deepspeed" and plain(sched.name) not in DEEPSPEED_SCHEDULERS:
        problems.append(
            f"scheduler.name={plain(sched.name)} has no DeepSpeed equivalent: use scheduler.owner=ds_exp, or one of "
            f"{', '.join(DEEPSPEED_SCHEDULERS)} with scheduler.owner=deepspeed"
        )
    for key in ("micro_batch_size", "gradient_accumulation_steps", "epochs", "log_every", "max_evals"):
        if getattr(train, key) < 1:
            problems.append(f"train.{key}={getattr(train, key)}: must be >= 1")
    if train.eval_micro_batch_size is not None and train.eval_micro_batch_size < 1:
        problems.append(f"train.eval_micro_batch_size={train.eval_micro_batch_size}: must be >= 1 or null")
    if train.max_steps == 0 or train.max_steps < -1:
        problems.append(
            f"train.max_steps={train.max_steps}: give a positive number of steps, or -1 to use train.epochs"
        )
    elif train.max_steps > 0 and sched.warmup_steps <= train.max_steps:  # else the run start says it, data known
        warmup = int(sched.warmup_steps) or math.ceil(train.max_steps * sched.warmup_ratio)
        problems += filter(None, [decay_problem(sched, train.max_steps, warmup)])
    for key in ("eval_every", "save_every", "keep_last", "max_bad_steps", "export_every", "export_keep_last"):
        if getattr(train, key) < 0:
            problems.append(f"train.{key}={getattr(train, key)}: must be >= 0")
    if train.gradient_clipping < 0:
        problems.append(f"train.gradient_clipping={train.gradient_clipping}: must be >= 0 (0 = no clipping)")
    global_batch = train.global_batch_size
    per_rank = samples_per_rank(train)
    if global_batch != "auto":
        if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
            problems.append(f"train.global_batch_size={global_batch}: give a positive integer or auto")
        elif per_rank >= 1 and global_batch % per_rank:
            problems.append(
                f"train.global_batch_size={global_batch} is not a multiple of train.micro_batch_size x "
                f"train.gradient_accumulation_steps = {per_rank}: the batch arithmetic cannot hold; use auto"
            )
        elif per_rank >= 1:
            sp = int(cfg.dist.sequence_parallel_size)
            if sp >= 1 and world % sp == 0 and global_batch != per_rank * data_parallel_size(world, sp):
                problems.append(global_batch_mismatch(cfg.train, world, sp))
    if not 1 <= cfg.dist.timeout_minutes <= MAX_TIMEOUT_MINUTES:
        problems.append(
            f"dist.timeout_minutes={cfg.dist.timeout_minutes}: must be >= 1 and at most {MAX_TIMEOUT_MINUTES} (a "
            "year; torch counts the timeout in nanoseconds and longer ones overflow); the default is 30"
        )
    if not 1 <= cfg.dist.master_port <= 65535:
        problems.append(f"dist.master_port={cfg.dist.master_port}: a TCP port is from 1 to 65535 (e.g. 29500)")
    # a value refused above for its range is not said twice
    return problems + [line for key, line in _non_finite(cfg) if not any(p.startswith(f"{key}=") for p in problems)]


def _non_finite(cfg: Config) -> list[tuple[str, str]]:
    """Every number of the config is finite: nan and inf parse as floats, and nothing in a run means either.
    (model.arch is checked with the architecture; the DeepSpeed config is DeepSpeed's to read.)"""
    problems: list[tuple[str, str]] = []

    def walk(value: object, key: str) -> None:
        if key in ("model.arch", "deepspeed"):
            return
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        elif isinstance(value, (list, tuple)):
            if any(isinstance(v, float) and not math.isfinite(v) for v in value):
                problems.append((key, f"{key}={list(value)}: every number must be finite"))
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append((key, f"{key}={value}: must be a finite number"))

    walk(cfg, "")
    return problems


def _check_precision(cfg: Config, accelerator: str) -> list[str]:
    dtype = plain(cfg.precision.dtype)
    if dtype == "fp16" and not supports_fp16(accelerator):
        return [
            f'precision=fp16: the {accelerator} accelerator cannot train in fp16 (DeepSpeed: "Type fp16 is not '
            'supported on your device"); use precision=bf16 or precision=fp32'
        ]
    if dtype == "bf16" and supports_bf16(accelerator) is False:
        return [f"precision=bf16: the {accelerator} accelerator cannot train in bf16; use precision=fp32"]
    return []


def _check_eval(cfg: Config) -> list[str]:
    sampling = sampling_problems(cfg.eval.temperature, cfg.eval.top_p, cfg.eval.top_k, key=lambda name: f"eval.{name}")
    problems = [line for line in sampling if "must be a finite number" not in line]  # said by _non_finite
    if cfg.eval.max_new_tokens < 1:
        problems.append(f"eval.max_new_tokens={cfg.eval.max_new_tokens}: must be >= 1")
    if cfg.eval.prompts_file and (special := special_file_problem("eval.prompts_file", cfg.eval.prompts_file)):
        problems.append(special)
    elif cfg.eval.prompts_file and not Path(cfg.eval.prompts_file).expanduser().is_file():
        problems.append(
            f"eval.prompts_file={cfg.eval.prompts_file}: file not found; give a text file with one prompt per line"
        )
    return problems


def _check_resume(cfg: Config) -> list[str]:
    if cfg.resume in (None, "auto"):
        return []
    if (special := special_file_problem("resume", cfg.resume)) is not None:
        return [special]
    if not Path(cfg.resume).expanduser().exists():
        return [f"resume={cfg.resume}: no such checkpoint directory; give a run's checkpoints directory or resume=auto"]
    return []


def config_problems(
    cfg: Config, *, accelerator: str, world_size: int, run_dir: Path | None = None
) -> tuple[list[str], dict[str, Any]]:
    """Every problem of the config's values and combinations (one line each), and the merged DeepSpeed config
    (run-time "auto" kept; {} when it cannot be built). `world_size`: the launch's (for the global batch);
    `run_dir`, when known, places the output directories that are given as absolute paths."""
    problems = _check_model(cfg) + _check_speed_features(cfg, accelerator) + _check_numbers(cfg, world_size)
    problems += [problem] if (problem := experiment_name_problem(cfg.experiment_name)) else []
    problems += (
        _check_precision(cfg, accelerator) + _check_resume(cfg) + _check_eval(cfg) + check_output_paths(cfg, run_dir)
    )
    problems += check_sequence_parallel(cfg, world_size) + lora_problems(cfg, accelerator) + logger_problems(cfg)
    problems += long_context_problems(cfg)
    ds: dict[str, Any] = {}
    try:
        precision = decide_precision(cfg.precision.dtype, accelerator, supports_bf16(accelerator))
        ds = resolve_ds_config(cfg, RunFacts(precision=precision), partial=True)
    except ConfigError as err:
        problems += err.problems
    if ds:
        problems += (
            _check_zero_and_offload(cfg, ds)
            + placement_problems(cfg, ds, accelerator, lambda path, value, key: _setting(cfg, path, value, key))
            + zero_problems(cfg, ds)
        )
    return problems, ds
