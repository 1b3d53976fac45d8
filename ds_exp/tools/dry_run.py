"""`dry_run=true`: everything up to building the engine, without weights: the model's config gives the sizes, "auto" is
filled, per-rank memory estimated; ds_config.json and plan.json are written, a short plan printed."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ds_exp.config.ds_config import get_path, replaced_by_config_file
from ds_exp.config.features import feature_hooks, feature_settings, plan_notes
from ds_exp.config.memory_plan import (
    estimate_model_states,
    human_bytes,
    optimizer_state,
    plan_micro_batch,
    run_estimate,
)
from ds_exp.config.model_checks import max_seq_len_notes
from ds_exp.config.plan import plan_run
from ds_exp.config.precision import detect_accelerator
from ds_exp.config.schema import Config, ModelConfig
from ds_exp.config.secrets import redact
from ds_exp.core.files import write_json_atomic
from ds_exp.data.pipeline import count_train_examples
from ds_exp.fast_path.settings import FastPathSettings
from ds_exp.launch.environment import detect_launch
from ds_exp.launch.hub import plans_from_arch
from ds_exp.model.architecture import (
    base_vocab_size,
    build_model_config,
    count_parameters,
    hidden_size_of,
    model_facts,
    padded_vocab_size,
    text_config,
)
from ds_exp.model.tokenizer import load_tokenizer
from ds_exp.runtime.device import resolved_precision
from ds_exp.train.hooks import RunHooks


def make_plan(cfg: Config, run_dir: Path, train_examples: int | None = None) -> dict[str, Any]:
    launch = detect_launch(cfg.dist)
    accelerator = detect_accelerator()
    precision = resolved_precision(cfg.precision.dtype, accelerator)
    # a preset's model that is not here: its published architecture
    from_arch = plans_from_arch(cfg.model, dry_run=cfg.dry_run)
    tokenizer = None if from_arch else load_tokenizer(cfg.model, cfg.data)
    model_config = build_model_config(cfg.model, tokenizer)
    hidden = hidden_size_of(model_config)
    text = text_config(model_config)
    base_vocab = base_vocab_size(cfg.model, tokenizer, text.vocab_size)  # what the export keeps
    padded = padded_vocab_size(len(tokenizer or ()), text.vocab_size, cfg.model.vocab_multiple)
    text.vocab_size = padded
    auto_class = RunHooks(feature_hooks(feature_settings(cfg))).objective().model_class  # a reward model's head
    counts = count_parameters(cfg.model, cfg.lora, model_config, auto_class)
    plan = plan_run(
        cfg,
        world_size=launch.world_size,
        train_examples=count_train_examples(cfg.data) if train_examples is None else train_examples,
        hidden_size=hidden,
        precision=precision,
        run_dir=run_dir,
    )
    ds_config = plan.ds_config
    notes = [
        *replaced_by_config_file(cfg.deepspeed.config_file, cfg.optimizer, cfg.scheduler, plan.total_steps),
        *max_seq_len_notes(cfg.model, cfg.data.max_seq_len),
        *plan_notes(feature_settings(cfg)),
    ]
    if from_arch:
        notes.insert(0, arch_note(cfg.model))
    stage = int(get_path(ds_config, "zero_optimization.stage"))
    shapes = model_facts(cfg, auto_class)
    memory = estimate_model_states(
        counts.total,
        counts.trainable,
        stage=stage,
        world_size=launch.world_size,
        precision=precision,
        offload_optimizer=str(get_path(ds_config, "zero_optimization.offload_optimizer.device", "none")),
        offload_param=str(get_path(ds_config, "zero_optimization.offload_param.device", "none")),
        state=optimizer_state(cfg.optimizer, cfg.offload, cfg.lora, shapes, accelerator),
    )
    per_rank = run_estimate(cfg, shapes, world_size=launch.world_size, precision=precision, accelerator=accelerator)
    fast = FastPathSettings.of(cfg).decide(accelerator, stage)
    planned = None
    if accelerator == "cuda":  # the planner's micro batch and checkpointing for this GPU's memory
        device = torch.cuda.get_device_properties(0).total_memory
        planned = plan_micro_batch(cfg, shapes, device, precision=precision, world_size=launch.world_size)
    return {
        "fast_path": {"attention": cfg.model.attn_implementation or "sdpa", **asdict(fast)},
        "planned_micro_batch_and_checkpointing": planned,
        "launcher": launch.launcher,
        "world_size": launch.world_size,
        "data_parallel_size": plan.data_parallel_size,
        "sequence_parallel_size": plan.sequence_parallel_size,
        "accelerator": accelerator,
        "precision": precision,
        "model": cfg.model.name_or_path or f"{cfg.model.name} (built from model.arch)",
        "model_type": model_config.model_type,
        "hidden_size": hidden,
        "vocab_size": base_vocab,
        "padded_vocab_size": padded,
        "parameters": counts.total,
        "trainable_parameters": counts.trainable,
        "lora_targets": len(counts.lora_targets),
        "lora_targets_by_part": counts.lora_parts,  # a vision-language model: how many in each tower
        "train_examples": plan.train_examples,
        "global_batch_size": plan.global_batch_size,
        "total_steps": plan.total_steps,
        "zero_stage": stage,
        "optimizer": str(cfg.optimizer.name),
        "memory_per_rank": {**memory.as_dict(), "activation_bytes": per_rank["activation_bytes"]},
        "estimate_per_rank_bytes": per_rank["estimate_bytes"],  # model states + activations (autotune's number)
        "max_seq_len": int(cfg.data.max_seq_len),
        "micro_batch_size": int(cfg.train.micro_batch_size),
        "ds_config": ds_config,
        "notes": notes,
    }


def arch_note(model: ModelConfig) -> str:
    return (
        f"planned from model.arch, the published architecture model={model.name} carries: "
        f"{model.name_or_path} is not on this machine, and nothing was downloaded (its tokenizer was not read: "
        "the vocabulary is model.arch's vocab_size)"
    )


def dry_run(cfg: Config, run_dir: Path, train_examples: int | None = None) -> dict[str, Any]:
    """`train_examples`: the data's count when the caller has it already; else counted here."""
    plan = make_plan(cfg, run_dir, train_examples)
    if detect_launch(cfg.dist).is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_dir / "ds_config.json", redact(plan["ds_config"]))
        write_json_atomic(run_dir / "plan.json", {k: v for k, v in plan.items() if k != "ds_config"})
        print(format_plan(plan, run_dir))
        for note in plan["notes"]:
            print(f"  note       {note}")
    return plan


def format_plan(plan: dict[str, Any], run_dir: Path) -> str:
    mem = plan["memory_per_rank"]
    lines = [
        f"ds_exp dry run -> {run_dir / 'ds_config.json'}",
        f"  launch     {plan['launcher']}, world size {plan['world_size']}{_parallel_words(plan)}, "
        f"{plan['accelerator']}, {plan['precision']}",
        f"  model      {plan['model']} ({plan['model_type']}, hidden {plan['hidden_size']}, "
        f"vocab {plan['vocab_size']}"
        + (
            f", padded to {plan['padded_vocab_size']} for training"
            if plan["padded_vocab_size"] != plan["vocab_size"]
            else ""
        )
        + ")",
        f"  params     {plan['parameters']:,} total, {plan['trainable_parameters']:,} trainable"
        + (f" ({plan['lora_targets']} LoRA layers{_by_part(plan)})" if plan["lora_targets"] else ""),
        f"  data       {plan['train_examples']:,} train examples, global batch {plan['global_batch_size']}, "
        f"{plan['total_steps']:,} optimizer steps",
        f"  ZeRO {plan['zero_stage']}     per rank: params {human_bytes(mem['params_bytes'])}, grads "
        f"{human_bytes(mem['grads_bytes'])}, optimizer ({plan['optimizer']}) {human_bytes(mem['optimizer_bytes'])} -> "
        f"device {human_bytes(mem['device_bytes'])}, host {human_bytes(mem['host_bytes'])} (model states)",
        f"  activations ~{human_bytes(mem['activation_bytes'])} per rank for a micro batch of "
        f"{plan['micro_batch_size']} x {plan['max_seq_len']:,} tokens -> ~"
        f"{human_bytes(plan['estimate_per_rank_bytes'])} per rank in all"
        + (" (host memory counted: this is a CPU)" if plan["accelerator"] == "cpu" else ""),
        "  fast path  " + ", ".join(f"{k} {_on(v)}" for k, v in plan["fast_path"].items()),
    ]
    if plan["planned_micro_batch_and_checkpointing"]:
        micro, checkpointing = plan["planned_micro_batch_and_checkpointing"]
        lines.append(
            f"  planner    for this GPU: train.micro_batch_size={micro} "
            f"model.gradient_checkpointing={str(checkpointing).lower()}"
        )
    return "\n".join(lines)


def _by_part(plan: dict[str, Any]) -> str:
    """`: 238 in model.language_model, 0 in model.vision_tower` for a model of several towers."""
    parts = plan.get("lora_targets_by_part") or {}
    return ": " + ", ".join(f"{count} in {part}" for part, count in parts.items()) if parts else ""


def _on(value: object) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _parallel_words(plan: dict[str, Any]) -> str:
    """How the world splits, where sequence parallelism is on."""
    sp = plan.get("sequence_parallel_size") or 1
    if sp == 1:
        return ""
    return f" = data-parallel {plan['data_parallel_size']} x sequence-parallel {sp}"
