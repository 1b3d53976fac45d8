"""What `python -m ds_exp.evaluate` scores, how and where, decided before torch: the target (a run directory, an
export or model directory, a checkpoint), the tasks, the options over the run's eval.harness, the output directory."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ds_exp.config.precision import detect_accelerator
from ds_exp.config.schema import Config
from ds_exp.core.errors import ConfigError, RunFailed
from ds_exp.evaluation.checks import TaskSpec, device_problems, resolve_tasks, task_problems
from ds_exp.evaluation.fit import CLI_KEYS, Asked, check_room, model_dir_fit, run_model_fit
from ds_exp.evaluation.settings import HarnessConfig
from ds_exp.exports.checks import check_target, find_checkpoint, refuse_reward_model, run_dir_of
from ds_exp.exports.on_disk import (
    ADAPTER_CONFIG,
    RUN_CONFIG,
    WRITTEN_BY_RUN,
    checkpoint_step,
    read_metadata,
    run_config,
    step_export_dir,
)
from ds_exp.launch.storage import check_writable
from ds_exp.resume.settings import moved_base
from ds_exp.resume.store import COMPLETE_MARKER

FEW = "give a number of questions >= 1, a fraction in (0, 1), or leave it out"


@dataclass
class Plan:
    """What is scored, how, and where the files go: everything decided before anything heavy."""

    model_dir: Path  # the export lm-eval loads (made first from `checkpoint` when given)
    specs: list[TaskSpec]
    harness: HarnessConfig  # the run's eval.harness with the command's options over it
    cfg: Config | None  # the run's config (its template, data cache, embedded task), when known
    out_dir: Path
    base: bool  # the run's base model beside
    checkpoint: Path | None = None


def make_plan(args: argparse.Namespace) -> Plan:
    run_dir, model_dir, checkpoint, cfg, pair = _target(args.target)
    refuse_reward_model(
        model_dir, "lm-eval's tasks cannot score it", reward_run=cfg is not None and str(cfg.objective.name) == "reward"
    )
    if cfg is None and args.base:
        raise ConfigError(f"--base: {args.target} is not a run's, so it has no base model to find; leave it out")
    if cfg is not None and (args.base or checkpoint is not None or (pair and not args.no_base)):
        cfg.model = moved_base(cfg.model, args.base)  # the base is built (an export first, its scores)
    harness = _options(args, cfg)
    problems = [] if harness.limit is None or harness.limit > 0 else [f"--limit={harness.limit}: {FEW}"]
    problems += device_problems(harness.device, "--device", detect_accelerator())  # --batch-size, --num-fewshot:
    lengths = harness.lengths(cfg.data.max_seq_len if cfg else 512)  # parsed in their range
    specs, more = resolve_tasks(list(args.tasks), lengths, key="TASK")
    if problems + more:
        raise ConfigError(problems + more)
    model = model_dir_fit(model_dir) if checkpoint is None or cfg is None else run_model_fit(cfg.model)
    more, size = task_problems(specs, model, Asked(harness.limit, harness.num_fewshot, CLI_KEYS), lengths)
    if more:
        raise ConfigError(more)
    if args.output:
        out_dir = Path(args.output).expanduser()
    elif run_dir is not None:
        out_dir = run_dir / "eval" if pair else run_dir / "eval" / model_dir.name
    else:
        out_dir = model_dir.with_name(f"{model_dir.name}-eval")
    check_writable(out_dir, "--output")
    base = bool(pair and not args.no_base)
    check_room(out_dir, "--output", size * (2 if base else 1))
    return Plan(model_dir, specs, harness, cfg, out_dir, base, checkpoint)


def _options(args: argparse.Namespace, cfg: Config | None) -> HarnessConfig:
    given = {
        "limit": args.limit,
        "num_fewshot": args.num_fewshot,
        "batch_size": args.batch_size,
        "device": args.device,
        "template": False if args.no_template else None,
    }
    if args.passkey_lengths:
        try:
            given["passkey_lengths"] = [int(n) for n in args.passkey_lengths.split(",")]
        except ValueError:
            lengths = args.passkey_lengths
            raise ConfigError(f"--passkey-lengths={lengths}: give lengths in tokens, e.g. 256,1024") from None
        if any(n < 64 for n in given["passkey_lengths"]):
            raise ConfigError(f"--passkey-lengths={args.passkey_lengths}: give lengths >= 64 tokens")
    own = dataclasses.replace(cfg.eval.harness) if cfg is not None else HarnessConfig()
    return dataclasses.replace(own, **{k: v for k, v in given.items() if v is not None})


Target = tuple[Path | None, Path, Path | None, Config | None, bool]


def _target(given: str) -> Target:
    """(run directory, model directory, checkpoint to export first, the run's config, base and tuned) of TARGET."""
    path = Path(given).expanduser()
    if not path.exists():
        raise ConfigError(f"{given}: no such directory; give a run directory, an export or a checkpoint")
    if (path / RUN_CONFIG).is_file():
        cfg = run_config(path)
        export = path / cfg.train.export_dir
        if not (export / "config.json").is_file():
            raise ConfigError(
                f"{given} is a run directory without its final export ({export} holds no model): score one of its "
                f"checkpoints (python -m ds_exp.evaluate {path / cfg.train.checkpoint_dir}/step<N> TASK ...), or "
                f"export one first (python -m ds_exp.export {given})"
            )
        return path, export, None, cfg, True
    if (path / "config.json").is_file():  # one model: an export (of a run: its settings), or any model directory
        origin = read_metadata(path).get("origin") or {}
        for run_dir in (path.parent, Path(str(origin.get("run_dir") or "/nonexistent")).expanduser()):
            if (run_dir / RUN_CONFIG).is_file() and origin:
                return run_dir, path, None, run_config(run_dir), False
        return None, path, None, None, False
    if (path / ADAPTER_CONFIG).is_file():
        raise ConfigError(
            f"{given} is a LoRA adapter, not a whole model: score the merged export (the run's hf_model, or python "
            "-m ds_exp.export CHECKPOINT --merged)"
        )
    marks = (COMPLETE_MARKER, "*model_states.pt", f"*/{COMPLETE_MARKER}")  # a checkpoint, or a checkpoints directory
    if any(any(path.glob(mark)) for mark in marks):
        return _checkpoint(given)
    raise ConfigError(
        f"{given}: not a model: no config.json (a Hugging Face model directory), no {RUN_CONFIG} (a run directory) "
        "and no checkpoint; give a run directory, an export such as <run dir>/hf_model, or a checkpoint step<N>"
    )


def _checkpoint(given: str) -> Target:
    """A checkpoint is scored as its export: the one `python -m ds_exp.export` writes (reused when it is there)."""
    tag_dir = find_checkpoint(given)
    run_dir = run_dir_of(tag_dir)
    cfg = run_config(run_dir)
    step = checkpoint_step(tag_dir)
    target = step_export_dir(run_dir / cfg.train.export_dir, step)
    try:
        check_target(target, key="the checkpoint's export", fix="move it away", adapter=False)
    except RunFailed as err:
        raise ConfigError(str(err)) from None
    origin = read_metadata(target).get("origin") or {}
    if (target / "config.json").is_file() and origin.get("step") == step:
        return run_dir, target, None, cfg, False  # exported already (by the run, or python -m ds_exp.export)
    if origin.get("written_by") == WRITTEN_BY_RUN:
        raise ConfigError(f"{target} is the run's own export of step {origin.get('step')}; it is not replaced")
    check_writable(target.parent, "the checkpoint's export")
    return run_dir, target, tag_dir, cfg, False
