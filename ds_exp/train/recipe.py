"""The supervised fine-tuning recipe (DeepSpeed-Chat step 1's main.py, readable and exact), top to bottom:

hooks = RunHooks(feature_hooks(feature_settings(cfg)))  # the features this run turns on, each its own settings
with Session(cfg, run_dir) as session:     # signals, process group, logs, summary.json: ds_exp/train/session.py
    session.start()
    run.work = setup(cfg, session, hooks)  # named steps: model config, data, plan, resume point, model, engine
    hooks.after_setup(run)                 # the features' named points (ds_exp/train/hooks.py), run: Run(...)
    start = resume(cfg, session, run.work, hooks)  # the checkpoint's state, or a fresh start (train/resuming.py)
    train(cfg, run, start)                 # the loop, evaluations, generations, checkpoints, step exports
    hooks.after_train(run)                 # the final export (ds_exp/exports/), then each after_export
    hooks.after_run(run)                   # the features' work on what the run left (lm-eval scores: its status)
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from ds_exp.checkpoint.checkpointer import Checkpointer
from ds_exp.checkpoint.frozen import built_base
from ds_exp.checkpoint.universal import PARAM_NAMES_KEY, ds_config_for_load, param_names
from ds_exp.config.ds_config import replaced_by_config_file
from ds_exp.config.features import feature_hooks, feature_settings
from ds_exp.config.memory_plan import checkpoint_bytes, optimizer_state
from ds_exp.config.model_checks import max_seq_len_notes
from ds_exp.config.optimizer_settings import OptimizerConfig
from ds_exp.config.plan import RunPlan, plan_run
from ds_exp.config.schema import (
    Config,
    DataConfig,
    LoraConfig,
    ModelConfig,
    SchedulerConfig,
    TrainConfig,
    plain,
)
from ds_exp.config.secrets import redact, register_secrets
from ds_exp.core import compat
from ds_exp.core.files import write_json_atomic
from ds_exp.data.checks import no_eval_note
from ds_exp.data.pipeline import SFTData, prepare_sft_data
from ds_exp.data.templates import first_template
from ds_exp.launch.run_logging import FILE_LOGGER
from ds_exp.model.architecture import build_model_config, check_lora, hidden_size_of
from ds_exp.model.build import BuiltModel, build_model
from ds_exp.model.engine import TrainingEngine, build_engine, check_deepspeed_config, parameter_groups, release_engine
from ds_exp.model.tokenizer import load_tokenizer
from ds_exp.resume.settings import model_section, settings_of
from ds_exp.resume.store import TrainState, read_marker
from ds_exp.resume.trajectory import trajectory_of
from ds_exp.runtime.process_group import all_reduce_sum
from ds_exp.runtime.signals import StopRequested
from ds_exp.train.disk_space import check_disk_space
from ds_exp.train.evaluate import Generations
from ds_exp.train.flops import device_name, flops_model, numel, peak_flops
from ds_exp.train.generate import Sampling, check_generation_room, load_prompts, stop_token_ids
from ds_exp.train.hooks import Run, RunHooks
from ds_exp.train.loop import Loop, Progress
from ds_exp.train.metrics import Metrics
from ds_exp.train.resuming import resume, resume_plan
from ds_exp.train.session import Session, training_line
from ds_exp.train.step import Objective, Ranks
from ds_exp.train.workload import Workload

log = logging.getLogger("ds_exp.train")
file_log = logging.getLogger(FILE_LOGGER)


def recipe_main(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """Train under whatever launcher started this process; write metrics, summary, checkpoints and export."""
    hooks = RunHooks(feature_hooks(feature_settings(cfg)))  # the features this run turns on, each with its own settings
    with Session(cfg, run_dir) as session:
        run = Run(session, hooks)
        try:
            session.start()
            run.work = setup(cfg, session, hooks)
            hooks.after_setup(run)
            start = resume(cfg.resume, cfg.train, cfg.optimizer, session, run.work, hooks)
            run.run_id = start.run_id
            train(cfg, run, start)
            hooks.after_train(run)
        finally:
            if run.work is not None:
                release_engine(run.work.engine)  # its memory and hooks, before a later job of this process
            hooks.after_release(run)
        run.work = None  # the model and optimizer state go before a feature loads the export (lm-eval)
        hooks.after_run(run)  # once the engine is released (lm-eval scores); never fails the completed run
    return {k: v for k, v in asdict(session.state).items() if k != "run_dir"}


def setup(cfg: Config, session: Session, hooks: RunHooks) -> Workload:
    """Everything the loop uses, as named steps, cheapest failure first: model config, data, plan, resume checkpoint,
    disk, engine. The objective decides the data, the model's class, the collator and the loss."""
    objective = hooks.objective()
    ranks = Ranks.of(session.rank, session.world, cfg.dist.sequence_parallel_size)  # checked by the feature's hooks
    # the ranks that draw different samples: every step's global batch is micro x accumulation x dp
    session.state.data_parallel_size, session.state.sequence_parallel_size = ranks.dp_size, ranks.size
    tokenizer, model_config = read_model_config(cfg.model, cfg.data, cfg.lora, session)
    hooks.after_model_config(Run(session, hooks), model_config)
    data = tokenized_data(cfg.data, cfg.train.seed, session, tokenizer, objective)
    check_generation_room(cfg.eval, model_config, tokenizer, first_template(data.stats))  # the prompts fit
    plan = plan_run(
        cfg,
        world_size=session.world,
        train_examples=len(data.train),
        hidden_size=hidden_size_of(model_config),
        precision=session.precision,
        run_dir=session.run_dir,
    )
    if session.is_main:
        log.info(training_line(cfg.lora, plan.ds_config, session.precision, plan.data_parallel_size, ranks.size))
    settings = settings_of(cfg, session.world, plan.ds_config, session.precision)
    resume_from, universal = resume_plan(cfg.resume, cfg.train, session, settings)
    ds_config = final_ds_config(cfg.deepspeed.config_file, cfg.optimizer, cfg.scheduler, session, plan, universal)
    built = build_model(cfg, tokenizer, ds_config, hooks.hooks, objective.model_class)
    zero3 = ds_config["zero_optimization"]["stage"] == 3
    base = built_base(cfg.model, cfg.train.seed, built.model, zero3=zero3, checkpoint=resume_from)
    parameters, trainable = record_model(cfg.model, cfg.train, cfg.optimizer.lr, session, built, plan, ds_config)
    needed = checkpoint_bytes(
        trainable,
        session.precision,
        optimizer_state(cfg.optimizer, cfg.offload, cfg.lora, accelerator=session.accelerator),
    )
    start_step = int(read_marker(resume_from).get("step", 0)) if resume_from is not None else 0
    check_disk_space(
        cfg.train,
        hooks,
        session,
        needed,
        parameters,
        trainable=trainable,
        start_step=start_step,
        total_steps=plan.total_steps,
    )
    engine = training_engine(cfg.optimizer, cfg.scheduler, cfg.deepspeed.config_file, session, built, ds_config, plan)
    return Workload(
        tokenizer=tokenizer,
        data=data,
        # under sequence parallelism every row splits into N equal slices, and position_ids carry the causality
        collator=objective.collator(
            tokenizer,
            pad_to_multiple_of=ranks.size if ranks.enabled else None,
            isolate_packed=bool(cfg.data.packing),
            position_ids=ranks.enabled,
        ),
        total_steps=plan.total_steps,
        steps_per_epoch=plan.steps_per_epoch,
        warmup_steps=plan.warmup_steps,
        ds_config=ds_config,
        settings=settings,
        resume_from=resume_from,
        universal=universal,
        trajectory=trajectory_of(
            cfg.train,
            cfg.scheduler,
            cfg.optimizer.lr,
            total_steps=plan.total_steps,
            warmup_steps=plan.warmup_steps,
            world_size=plan.data_parallel_size,
            data_key=Path(data.stats["cache_path"]).name,
        ),
        built=built,
        engine=engine.deepspeed_engine,
        metric_scheduler=engine.metric_scheduler,
        schedule_name=str(plain(cfg.scheduler.name)),
        flops=flops_model(built.model, built.config),
        peak_flops=session.state.peak_flops,
        checkpoint_bytes=needed,
        base=base,
        ranks=ranks,
        objective=objective,
    )


def read_model_config(
    model: ModelConfig, data: DataConfig, lora: LoraConfig, session: Session
) -> tuple[PreTrainedTokenizerBase, PretrainedConfig]:
    """The tokenizer and the model's config (no weights), lora.* checked against the model's layers."""
    if session.is_main:
        for note in max_seq_len_notes(model, data.max_seq_len):
            log.warning(note)
    tokenizer = load_tokenizer(model, data)
    model_config = build_model_config(model, tokenizer)
    check_lora(model, lora, model_config)
    return tokenizer, model_config


def tokenized_data(
    data_cfg: DataConfig, seed: int, session: Session, tokenizer: PreTrainedTokenizerBase, objective: Objective
) -> SFTData:
    """The training and eval sets, tokenized (or read from the cache)."""
    data = prepare_sft_data(data_cfg, tokenizer, seed=seed, pairs=objective.pairs)
    file_log.info("data statistics: %s", data.stats)  # the console has the pipeline's sentence
    if session.is_main and len(data.eval) == 0:
        log.warning(no_eval_note(data_cfg))
    return data


def final_ds_config(
    config_file: str | None,
    optimizer: OptimizerConfig,
    scheduler: SchedulerConfig,
    session: Session,
    plan: RunPlan,
    universal: bool,
) -> dict[str, Any]:
    """The plan's DeepSpeed config (loading a universal checkpoint where the resume needs one), checked and written."""
    ds_config = ds_config_for_load(plan.ds_config) if universal else plan.ds_config
    if session.is_main:
        for note in replaced_by_config_file(config_file, optimizer, scheduler, plan.total_steps):
            log.warning(note)
    register_secrets(ds_config)  # a user's DeepSpeed JSON may hold keys (comet.api_key)
    check_deepspeed_config(ds_config, config_file)
    if session.is_main:
        write_json_atomic(session.run_dir / "ds_config.json", redact(ds_config))
    return ds_config


def record_model(
    model: ModelConfig,
    train_cfg: TrainConfig,
    lr: float,
    session: Session,
    built: BuiltModel,
    plan: RunPlan,
    ds_config: dict[str, Any],
) -> tuple[int, int]:
    """(parameters, trainable), logged, and what the run's summary.json says of the model and the plan."""
    parameters = sum(numel(p) for p in built.model.parameters())
    trainable = sum(numel(p) for p in built.model.parameters() if p.requires_grad)
    lora = built.lora
    log.info(
        "model: %s, %s parameters, %s trainable (%.2f%%)%s",
        model.name_or_path or f"{model.name} (built from model.arch)",
        f"{parameters:,}",
        f"{trainable:,}",
        100.0 * trainable / max(parameters, 1),
        f", LoRA rank {lora.dim} on {len(lora.targets)} layers" if lora else "",
    )
    state = session.state
    state.model = model.name_or_path or model.name
    state.lora_dim, state.parameters, state.trainable_parameters = lora.dim if lora else 0, parameters, trainable
    state.total_steps, state.zero_stage = plan.total_steps, int(ds_config["zero_optimization"]["stage"])
    state.train_examples, state.global_batch_size = plan.train_examples, int(ds_config["train_batch_size"])
    state.peak_lr = float(ds_config.get("optimizer", {}).get("params", {}).get("lr", lr))  # the top
    state.device = device_name(session.accelerator)
    state.peak_flops = peak_flops(state.device, session.precision, train_cfg.peak_tflops)
    return parameters, trainable


def training_engine(
    optimizer: OptimizerConfig,
    scheduler: SchedulerConfig,
    config_file: str | None,
    session: Session,
    built: BuiltModel,
    ds_config: dict[str, Any],
    plan: RunPlan,
) -> TrainingEngine:
    """deepspeed.initialize with the optimizer and the schedule."""
    engine = build_engine(
        built.model,
        ds_config,
        optimizer_cfg=optimizer,
        scheduler_cfg=scheduler,
        config_file=config_file,
        total_steps=plan.total_steps,
        warmup_steps=plan.warmup_steps,
        accelerator=session.accelerator,
        mpu=built.mpu,
    )
    session.state.optimizer = engine.optimizer_name
    # every rank's own record of what it trains with (a study checks each rank got the trial's value)
    groups = engine.deepspeed_engine.optimizer.param_groups
    peak = [float(g.get("initial_lr", g["lr"])) for g in groups]  # the schedule's base: optimizer.lr
    file_log.info("learning rate per parameter group: peak %s, step 1 %s", peak, [float(g["lr"]) for g in groups])
    session.state.fast_path = built.fast_path
    return engine


def train(cfg: Config, run: Run, start: TrainState) -> None:
    """Evaluate and generate around the loop, and save the final checkpoint."""
    session, work = run.session, run.work
    assert work is not None
    metrics_log, trackers = session.open_sinks(start)
    progress = Progress(start.step, start.epoch, start.step_in_epoch)
    if start.step > 0:
        progress.last_save_step = start.step  # that checkpoint exists: it is never written again
    session.state.steps = start.step
    # a resumed window's sums are over all ranks: rank 0 carries them, so the reduction counts them once
    window = (start.window_loss_sum, start.window_label_tokens, *start.window_sums)
    carried = window if session.is_main else (0.0,) * len(window)
    metrics = Metrics(
        metrics_log,
        trackers,
        device=work.engine.device,
        world_size=session.world,
        peak_flops=work.peak_flops,
        carried=carried,
        objective=work.objective,
    )
    generations = Generations(
        load_prompts(cfg.eval) if work.objective.generates else [],  # a reward model completes nothing
        tokenizer=work.tokenizer,
        template=first_template(work.data.stats),
        max_new_tokens=int(cfg.eval.max_new_tokens),
        stop_ids=stop_token_ids(work.tokenizer, cfg.data.end_of_conversation_token),
        path=session.run_dir / "generations.jsonl",
        sampling=Sampling.of(cfg.eval),
    )
    checkpoints = Checkpointer(
        work.engine,
        session.run_dir / cfg.train.checkpoint_dir,
        rank=session.rank,
        keep_last=cfg.train.keep_last,
        needed_bytes=work.checkpoint_bytes,
        identity={
            "run_id": start.run_id,
            "branch": start.branch,
            "run_dir": start.run_dir,
            "trackers": trackers.ids(),  # each tracker's run id: a resume continues the same tracker runs
            "settings": work.settings,
            "trajectory": work.trajectory,
            "model_config": model_section(cfg.model),  # what an export of the checkpoint rebuilds the model with
            "base": work.base,  # the frozen weights it leaves out
        },
        extra=_stage0_names(cfg.optimizer, work),
    )
    run.metrics = metrics
    loop = Loop(cfg.train, cfg.eval, session, work, metrics, checkpoints, generations, progress, run)
    session.ready()
    try:
        if cfg.train.eval_at_start and progress.step == 0:
            session.state.initial_eval = loop.evaluate()
        if progress.step == 0:
            loop.generate()  # what the model says before training
        if cfg.train.keep_last == 0 and session.is_main:
            log.warning("train.keep_last=0: no checkpoint is ever deleted (every one saved is kept)")
        session.signals.immediate = False  # from here a signal is voted on and answered with a checkpoint
        (stop_votes,) = all_reduce_sum([float(session.signals.requested)], work.engine.device)
        if stop_votes:  # a signal during setup: nothing trained since the last checkpoint
            raise StopRequested(session.signals.reason, progress.step, None, session.signals.stopped_status)
        metrics.show_progress(work.total_steps, progress.step, session.is_main)
        loop.run()
        metrics.close_progress()
        if progress.last_eval_step != progress.step:
            loop.evaluate()
        loop.check_end()  # a run that ends non-finite is diverged: nothing below is written
        if generations.last_step != progress.step:
            loop.generate()  # and after
        if cfg.train.save_final_checkpoint and progress.last_save_step != progress.step:
            loop.save()
    finally:
        metrics.write()
        metrics.close_progress()
        loop.loss_plot.draw(final=True)  # the run's picture as it ends, however it ends
        totals, state = metrics.totals, session.state
        state.train_seconds, state.train_tokens = totals.seconds, totals.tokens
        state.train_samples, state.train_flops = totals.samples, totals.flops
        state.skipped_steps, state.train_loss = totals.skipped_steps, totals.last_loss
        state.train_flops_row_attention = totals.flops_row_attention
        if work.built.fast_path.get("compile"):
            state.compile_s = compat.compile_seconds()  # torch.compile's own timers: not in train_seconds' speed


def _stage0_names(optimizer: OptimizerConfig, work: Workload) -> dict[str, Any] | None:
    """A ZeRO-0 optimizer state is indexed by number: its parameter names, for `python -m ds_exp.universal`."""
    if work.zero_stage != 0:
        return None

    model = work.built.model
    groups = parameter_groups(model, optimizer.weight_decay, list(optimizer.no_decay))
    return {PARAM_NAMES_KEY: param_names(model, groups)}
