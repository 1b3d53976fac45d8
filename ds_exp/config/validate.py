"""Semantic checks of a composed config, before anything heavy, all in one ConfigError. Each value's own problems come
first; the checks that combine values run only once every value is valid."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ds_exp.config.batch import data_parallel_size, global_batch_mismatch, samples_per_rank
from ds_exp.config.ds_config import MISSING, RunFacts, get_path, is_zero_stage, load_config_file, resolve_ds_config
from ds_exp.config.lora_checks import lora_problems
from ds_exp.config.model_checks import (
    arch_problems,
    local_model_problems,
    looks_like_local_path,
    max_new_tokens_problems,
    max_seq_len_problems,
)
from ds_exp.config.optimizer_checks import placement_problems, settings_problems
from ds_exp.config.output_paths import output_path_problems
from ds_exp.config.paths import not_a_directory
from ds_exp.config.place_checks import experiment_name_problem
from ds_exp.config.plan import decay_problem
from ds_exp.config.precision import decide_precision, supports_bf16, supports_fp16
from ds_exp.config.ranges import number_problems, range_problems, zero_value_problems
from ds_exp.config.resolvers import DEEPSPEED_SCHEDULERS
from ds_exp.config.sampling import sampling_problems
from ds_exp.config.schedule_kwargs import scheduler_kwargs_problems
from ds_exp.config.schema import (
    Config,
    EvalConfig,
    ModelConfig,
    PrecisionConfig,
    SchedulerConfig,
    TrainConfig,
    plain,
)
from ds_exp.config.shapes import shape_problems
from ds_exp.config.trackers import logger_problems
from ds_exp.core.errors import ConfigError
from ds_exp.core.user_paths import special_file_problem

# what a tokenizer directory holds (any one): fast tokenizers, their config, BPE, WordPiece and SentencePiece files
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")


def _model_path_problems(model: ModelConfig) -> list[str]:
    problems = []
    if model.name_or_path is None and model.arch is None:
        problems.append(
            "model.name_or_path is not set and the model has no `arch`: give model.name_or_path=<local dir or "
            "hub id> or pick a preset (model=tiny)"
        )
    for key in ("name_or_path", "tokenizer"):
        value = getattr(model, key)
        if value is not None and not str(value).strip():
            problems.append(f"model.{key} is empty: give a local directory or a hub id (or null)")
        if value is None or not looks_like_local_path(value):
            continue
        path = Path(value).expanduser()
        if key == "name_or_path" and (special := special_file_problem(f"model.{key}", value)) is not None:
            problems.append(special)  # (a tokenizer that is a device or a FIFO: "is not a directory" below)
        elif not path.exists():
            problems.append(f"model.{key}={value}: directory not found; give an existing local directory or a hub id")
        elif key == "name_or_path" and not (path / "config.json").is_file():
            problems.append(
                f"model.name_or_path={value} has no config.json: point it at a Hugging Face checkpoint directory"
            )
        elif key == "tokenizer" and not (path.is_dir() and any((path / f).is_file() for f in TOKENIZER_FILES)):
            what = "is not a directory" if not path.is_dir() else f"holds no tokenizer ({', '.join(TOKENIZER_FILES)})"
            problems.append(
                f"model.tokenizer={value} {what}: point it at a Hugging Face tokenizer (or model) directory, a hub "
                "id, or null for the model's own"
            )
    return problems


def _file_setting(file: str | None, path: str) -> str | None:
    """The user's DeepSpeed file when it sets `path` (messages then name the file and key), else None."""
    if not file:
        return None
    try:
        loaded = load_config_file(file)
    except ConfigError:
        return None  # reported on its own
    return file if get_path(loaded, path) is not MISSING else None


def _setting(file: str | None, path: str, value: object, group_key: str) -> str:
    """How a message names where a DeepSpeed value came from: the file and its key, or the ds_exp setting."""
    shown = json.dumps(value) if isinstance(value, bool) else value  # as the override is written: true, not True
    return _in_file(path, value, _file_setting(file, path)) or f"{group_key}={shown}"


def _zero_and_offload_problems(file: str | None, ds: dict[str, Any]) -> list[str]:
    """ZeRO stage and offload fit together; a value from the user's DeepSpeed file is named with its file and key."""
    stage = get_path(ds, "zero_optimization.stage", None)
    stage_file = _file_setting(file, "zero_optimization.stage")
    if not is_zero_stage(stage):
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
        offload_file = _file_setting(file, f"zero_optimization.offload_{kind}.device")
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
        device_file = _file_setting(file, f"zero_optimization.offload_{kind}.device")
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
        path_file = _file_setting(file, f"zero_optimization.offload_{kind}.nvme_path")
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


def _schedule_problems(sched: SchedulerConfig, train: TrainConfig, lr: float) -> list[str]:
    problems = []
    if sched.warmup_steps > 0 and sched.warmup_ratio > 0:
        problems.append("scheduler.warmup_steps and scheduler.warmup_ratio are both set: keep one, set the other to 0")
    if plain(sched.owner) == "deepspeed" and plain(sched.name) not in DEEPSPEED_SCHEDULERS:
        problems.append(
            f"scheduler.name={plain(sched.name)} has no DeepSpeed equivalent: use scheduler.owner=ds_exp, or one of "
            f"{', '.join(DEEPSPEED_SCHEDULERS)} with scheduler.owner=deepspeed"
        )
    if train.max_steps == 0:
        problems.append("train.max_steps=0: give a positive number of steps, or -1 to use train.epochs")
    elif train.max_steps > 0 and sched.warmup_steps <= train.max_steps:  # else the run start says it, data known
        warmup = int(sched.warmup_steps) or math.ceil(train.max_steps * sched.warmup_ratio)
        problems += filter(None, [decay_problem(sched, train.max_steps, warmup)])
    lr_end = sched.kwargs.get("lr_end")
    if plain(sched.name) == "polynomial" and plain(sched.owner) == "ds_exp" and lr_end is not None and lr_end >= lr:
        problems.append(
            f"scheduler.kwargs.lr_end={lr_end}: the polynomial schedule decays from optimizer.lr={lr} down to lr_end, "
            "so it must be smaller than optimizer.lr"
        )
    return problems


def _global_batch_problems(train: TrainConfig, world: int, sp: int) -> list[str]:
    global_batch = train.global_batch_size
    if global_batch == "auto":
        return []
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        return [f"train.global_batch_size={global_batch}: give a positive integer or auto"]
    per_rank = samples_per_rank(train)
    if global_batch % per_rank:
        return [
            f"train.global_batch_size={global_batch} is not a multiple of train.micro_batch_size x "
            f"train.gradient_accumulation_steps = {per_rank}: the batch arithmetic cannot hold; use auto"
        ]
    if world % sp == 0 and global_batch != per_rank * data_parallel_size(world, sp):
        return [global_batch_mismatch(train, world, sp)]
    return []


def _precision_problems(precision: PrecisionConfig, accelerator: str) -> list[str]:
    dtype = plain(precision.dtype)
    if dtype == "fp16" and not supports_fp16(accelerator):
        return [
            f'precision=fp16: the {accelerator} accelerator cannot train in fp16 (DeepSpeed: "Type fp16 is not '
            'supported on your device"); use precision=bf16 or precision=fp32'
        ]
    if dtype == "bf16" and supports_bf16(accelerator) is False:
        return [f"precision=bf16: the {accelerator} accelerator cannot train in bf16; use precision=fp32"]
    return []


def _eval_problems(eval_cfg: EvalConfig) -> list[str]:
    problems = sampling_problems(eval_cfg.temperature, eval_cfg.top_p, eval_cfg.top_k, key=lambda name: f"eval.{name}")
    prompts_file = eval_cfg.prompts_file
    if prompts_file and (special := special_file_problem("eval.prompts_file", prompts_file)):
        problems.append(special)
    elif prompts_file and not Path(prompts_file).expanduser().is_file():
        problems.append(f"eval.prompts_file={prompts_file}: file not found; give a text file with one prompt per line")
    return problems


def _resume_problems(resume: str | None) -> list[str]:
    if resume in (None, "auto"):
        return []
    if not resume.strip():
        return ["resume is empty: give a run's checkpoints directory, resume=auto, or null to start fresh"]
    path = Path(resume).expanduser()
    if not path.exists():
        return [f"resume={resume}: no such checkpoint directory; give a run's checkpoints directory or resume=auto"]
    if not path.is_dir():  # a file, a FIFO, a device: nothing a checkpoint is
        return [
            f"resume={resume} is not a directory; give a run's checkpoints directory, one step<N> of it, or resume=auto"
        ]
    return []


def value_problems(cfg: Config) -> list[str]:
    """Each value's own problems: a shape no check can look at (then nothing else), else one line per key."""
    shapes = shape_problems(cfg)
    if shapes:
        return shapes
    first: dict[str, str] = {}
    for key, line in [
        *number_problems(cfg),
        *range_problems(cfg),
        *zero_value_problems(cfg.zero),
        *scheduler_kwargs_problems(cfg.scheduler),
    ]:
        first.setdefault(key, line)
    return list(first.values())


def config_problems(
    cfg: Config, *, accelerator: str, world_size: int, run_dir: Path | None = None
) -> tuple[list[str], dict[str, Any]]:
    """Every problem of the config (one line each), and the merged DeepSpeed config ({} when it cannot be built)."""
    values = value_problems(cfg)
    if values:
        return values, {}
    model, file, sp = cfg.model, cfg.deepspeed.config_file, cfg.dist.sequence_parallel_size
    problems = (
        _model_path_problems(model)
        + arch_problems(model)
        + local_model_problems(model, dry_run=cfg.dry_run)
        + max_seq_len_problems(model, cfg.data.max_seq_len)
        + max_new_tokens_problems(model, cfg.eval)
        + settings_problems(cfg.optimizer)
        + _schedule_problems(cfg.scheduler, cfg.train, cfg.optimizer.lr)
        + _global_batch_problems(cfg.train, world_size, sp)
    )
    problems += [problem] if (problem := experiment_name_problem(cfg.experiment_name)) else []
    problems += (
        _precision_problems(cfg.precision, accelerator)
        + _resume_problems(cfg.resume)
        + _eval_problems(cfg.eval)
        + output_path_problems(cfg.train, run_dir)
    )
    problems += lora_problems(cfg.lora, accelerator, name_or_path=model.name_or_path, zero_stage=cfg.zero.stage)
    problems += logger_problems(cfg.logger, dry_run=cfg.dry_run)
    ds: dict[str, Any] = {}
    try:
        precision = decide_precision(cfg.precision.dtype, accelerator, supports_bf16(accelerator))
        ds = resolve_ds_config(cfg, RunFacts(precision=precision, sequence_parallel_size=sp), partial=True)
    except ConfigError as err:
        problems += err.problems
    if ds:
        problems += _zero_and_offload_problems(file, ds) + placement_problems(
            cfg.optimizer,
            ds,
            accelerator,
            sequence_parallel_size=sp,
            compile=cfg.train.compile,
            where=lambda path, value, key: _setting(file, path, value, key),
        )
    return problems, ds
