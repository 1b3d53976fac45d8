"""The supervised fine-tuning recipe (DeepSpeed-Chat step 1's main.py, readable and exact), top to bottom:

    with Session(cfg, run_dir) as session:     # signals, process group, logs, summary.json: ds_exp/train/session.py
        session.start()
        work = setup(cfg, session)             # tokenizer, data, DeepSpeed config, model, engine
        start = resume(cfg, session, work)     # the checkpoint to continue from, or a fresh start
        train(cfg, session, work, start)       # the loop, evaluations, generations, checkpoints
        RunExports(...).final()                # a Hugging Face model with the base model's identity

The loss of an optimizer step is the sum of token losses over the whole global batch divided by its number of
label tokens (ds_exp/train/step.py); perplexity is exp(summed eval token loss / eval label tokens)
(ds_exp/train/evaluate.py).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from ds_exp.checkpoint.checkpointer import Checkpointer, load_checkpoint
from ds_exp.checkpoint.universal import PARAM_NAMES_KEY, ds_config_for_load, load_state, param_names
from ds_exp.config.ds_config import RunFacts, replaced_by_config_file, resolve_ds_config
from ds_exp.config.memory_plan import checkpoint_bytes, optimizer_state
from ds_exp.config.model_checks import max_seq_len_notes
from ds_exp.config.plan import steps_per_epoch, total_steps, warmup_steps
from ds_exp.config.schema import Config, plain
from ds_exp.config.secrets import redact, register_secrets
from ds_exp.config.sp_checks import check_sequence_parallel
from ds_exp.core.errors import ConfigError
from ds_exp.core.files import write_json_atomic
from ds_exp.data.checks import no_eval_note
from ds_exp.data.pipeline import prepare_sft_data
from ds_exp.data.templates import first_template
from ds_exp.launch.exports import exports_off_trajectory, model_section
from ds_exp.launch.run_dir import completed_at, set_aside_attempt
from ds_exp.launch.run_logging import FILE_LOGGER
from ds_exp.model.architecture import build_model_config, check_lora, hidden_size_of
from ds_exp.model.build import BuiltModel, build_model
from ds_exp.model.engine import build_engine, check_deepspeed_config, lr_at, parameter_groups, release_engine
from ds_exp.model.sequence_parallel import SequenceParallel, check_heads, unregister
from ds_exp.model.tokenizer import load_tokenizer
from ds_exp.resume import trajectory
from ds_exp.resume.branches import is_same_run, set_aside_branch
from ds_exp.resume.settings import check_resume, layout_changes, needs_universal, sequence_parallel_change, settings_of
from ds_exp.resume.store import TrainState, find_resume_checkpoint, read_marker
from ds_exp.resume.trajectory import trajectory_of
from ds_exp.runtime.process_group import all_reduce_sum, broadcast
from ds_exp.runtime.signals import StopRequested
from ds_exp.train.collate import make_collator
from ds_exp.train.disk_space import check_disk_space
from ds_exp.train.evaluate import Generations
from ds_exp.train.exports import RunExports
from ds_exp.train.flops import device_name, flops_model, numel, peak_flops
from ds_exp.train.generate import Sampling, check_generation_room, load_prompts, stop_token_ids
from ds_exp.train.loop import Loop, Progress
from ds_exp.train.metrics import Metrics
from ds_exp.train.session import NothingToDo, Session
from ds_exp.train.workload import Workload

log = logging.getLogger("ds_exp.train")
file_log = logging.getLogger(FILE_LOGGER)


def recipe_main(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """Train under whatever launcher started this process; write metrics, summary, checkpoints and export."""
    with Session(cfg, run_dir) as session:
        work: Workload | None = None
        try:
            session.start()
            work = setup(cfg, session)
            start = resume(cfg, session, work)
            train(cfg, session, work, start)
            RunExports(cfg, session, work, start.run_id).final()
        finally:
            if work is not None:
                release_engine(work.engine)  # its memory and hooks, before a later job of this process
            unregister()  # transformers' attention table as it was, for a later job of this process
    return {k: v for k, v in asdict(session.state).items() if k != "run_dir"}


def setup(cfg: Config, session: Session) -> Workload:
    """Everything the loop uses, built in the order that fails cheapest first: the model's config before the data
    (a checkpoint transformers cannot read fails before tokenizing), the data before the weights."""
    state, world = session.state, session.world
    sp_problems = check_sequence_parallel(cfg, world)  # again with the world the group has (submitit: known here)
    if sp_problems:
        raise ConfigError(sp_problems)
    sp = SequenceParallel.of(session.rank, world, cfg.dist.sequence_parallel_size)
    dp = sp.dp_size  # the ranks that draw different samples: every step's global batch is micro x accumulation x dp
    state.data_parallel_size, state.sequence_parallel_size = dp, sp.size
    if session.is_main:
        for note in max_seq_len_notes(cfg):
            log.warning(note)
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    model_config = build_model_config(cfg, tokenizer)
    if sp.enabled:
        check_heads(model_config, sp.size)  # a hub model's heads, before its data and weights
    check_lora(cfg, model_config)  # lora.* against the model's layers, before its data and weights
    data = prepare_sft_data(cfg.data, tokenizer, seed=cfg.train.seed)
    file_log.info("data statistics: %s", data.stats)  # the console has the pipeline's sentence
    if session.is_main and len(data.eval) == 0:
        log.warning(no_eval_note(cfg.data))
    check_generation_room(cfg.eval, model_config, tokenizer, first_template(data.stats))  # before the weights
    steps = total_steps(len(data.train), cfg.train, dp)
    warmup = warmup_steps(cfg.scheduler, steps)
    facts = RunFacts(
        world, hidden_size_of(model_config), steps, warmup, session.precision, str(session.run_dir), sp.size
    )
    ds_config = resolve_ds_config(cfg, facts)
    settings = settings_of(cfg, world, ds_config, session.precision)
    resume_from, universal = resume_plan(cfg, session, settings)
    # what a stop before this attempt's first checkpoint names to continue (Session.continue_with)
    session.resume_source = resume_from.absolute() if resume_from else None
    if universal:  # deepspeed.initialize reads checkpoint.load_universal
        ds_config = ds_config_for_load(ds_config)
    if session.is_main:
        for note in replaced_by_config_file(cfg, facts):
            log.warning(note)
    register_secrets(ds_config)  # a user's DeepSpeed JSON may hold keys (comet.api_key); DeepSpeed logs its config
    check_deepspeed_config(ds_config, cfg.deepspeed.config_file)
    if session.is_main:
        write_json_atomic(session.run_dir / "ds_config.json", redact(ds_config))
    built = build_model(cfg, tokenizer, ds_config)
    parameters = sum(numel(p) for p in built.model.parameters())
    trainable = sum(numel(p) for p in built.model.parameters() if p.requires_grad)
    log_model(cfg, built, parameters, trainable)
    state.model = cfg.model.name_or_path or cfg.model.name
    state.lora_dim, state.parameters, state.trainable_parameters = cfg.lora.dim, parameters, trainable
    state.total_steps, state.zero_stage = steps, int(ds_config["zero_optimization"]["stage"])
    state.train_examples, state.global_batch_size = len(data.train), int(ds_config["train_batch_size"])
    state.peak_lr = float(ds_config.get("optimizer", {}).get("params", {}).get("lr", cfg.optimizer.lr))  # the top
    state.device = device_name(session.accelerator)
    state.peak_flops = peak_flops(state.device, session.precision, cfg.train.peak_tflops)
    state_size = optimizer_state(cfg, accelerator=session.accelerator)
    needed = checkpoint_bytes(parameters, trainable, session.precision, state_size)
    start_step = int(read_marker(resume_from).get("step", 0)) if resume_from is not None else 0
    check_disk_space(cfg, session, needed, parameters, start_step=start_step, total_steps=steps)
    engine = build_engine(
        built.model,
        ds_config,
        optimizer_cfg=cfg.optimizer,
        scheduler_cfg=cfg.scheduler,
        config_file=cfg.deepspeed.config_file,
        total_steps=steps,
        warmup_steps=warmup,
        accelerator=session.accelerator,
        mpu=built.mpu,
    )
    state.optimizer = engine.optimizer_name
    # every rank's own record of what it trains with (a study checks each rank got the trial's value)
    groups = engine.deepspeed_engine.optimizer.param_groups
    peak = [float(g.get("initial_lr", g["lr"])) for g in groups]  # the schedule's base: optimizer.lr
    file_log.info("learning rate per parameter group: peak %s, step 1 %s", peak, [float(g["lr"]) for g in groups])
    if cfg.train.compile:
        engine.deepspeed_engine.compile()  # torch.compile of the wrapped module, DeepSpeed's hooks kept working
    return Workload(
        tokenizer=tokenizer,
        data=data,
        # under sequence parallelism every row splits into N equal slices, and position_ids carry the causality
        collator=make_collator(
            tokenizer,
            pad_to_multiple_of=sp.size if sp.enabled else None,
            isolate_packed=bool(cfg.data.packing),
            position_ids=sp.enabled,
        ),
        total_steps=steps,
        steps_per_epoch=steps_per_epoch(len(data.train), cfg.train, dp),
        warmup_steps=warmup,
        ds_config=ds_config,
        settings=settings,
        resume_from=resume_from,
        universal=universal,
        trajectory=trajectory_of(
            cfg, total_steps=steps, warmup_steps=warmup, world_size=dp, data_key=Path(data.stats["cache_path"]).name
        ),
        built=built,
        engine=engine.deepspeed_engine,
        metric_scheduler=engine.metric_scheduler,
        schedule_name=str(plain(cfg.scheduler.name)),
        flops=flops_model(built.model, built.config),
        peak_flops=state.peak_flops,
        checkpoint_bytes=needed,
        sp=sp,
    )


def log_model(cfg: Config, built: BuiltModel, parameters: int, trainable: int) -> None:
    lora = built.lora
    log.info(
        "model: %s, %s parameters, %s trainable (%.2f%%)%s",
        cfg.model.name_or_path or f"{cfg.model.name} (built from model.arch)",
        f"{parameters:,}",
        f"{trainable:,}",
        100.0 * trainable / max(parameters, 1),
        f", LoRA rank {lora.dim} on {len(lora.targets)} layers" if lora else "",
    )


def resume_plan(cfg: Config, session: Session, settings: dict[str, Any]) -> tuple[Path | None, bool]:
    """The checkpoint to continue from (None: a fresh start), and whether its layout (world size, ZeRO stage,
    offload) changed so that it is loaded through DeepSpeed's universal format. Decided before the engine exists,
    since deepspeed.initialize reads that choice; other changed settings are refused here."""
    wanted = cfg.resume if cfg.resume is not None or session.launch.launcher != "submitit" else "auto"
    tag_dir = find_resume_checkpoint(wanted, session.run_dir, cfg.train.checkpoint_dir)
    if tag_dir is None:
        return None, False
    check_resume(cfg, tag_dir, settings)  # also where Hydra's callback did not run (submitit)
    saved = read_marker(tag_dir).get("settings") or {}
    if session.is_main:
        for line in layout_changes(saved, settings):
            log.warning("resume: %s", line)
        sp_line = sequence_parallel_change(saved, settings)
        if sp_line is not None:
            log.warning("resume: %s", sp_line)
    return tag_dir, needs_universal(saved, settings)


def resume(cfg: Config, session: Session, work: Workload) -> TrainState:
    """The state to start from: a checkpoint's (resume=auto / <path>), or step 0. A submitit job that SLURM
    requeued runs again in the same directory, so it continues whenever there is something to continue."""
    run_dir, tag_dir = session.run_dir, work.resume_from
    if tag_dir is None:
        wanted = cfg.resume if cfg.resume is not None or session.launch.launcher != "submitit" else "auto"
        if wanted is not None and session.is_main:
            moved = set_aside_attempt(run_dir)  # an attempt that left no checkpoint: start over beside it
            if moved is not None:
                log.warning("no complete checkpoint to resume from: starting over; the earlier attempt is in %s", moved)
        run_id, branch = broadcast((_new_run_id(), _new_run_id()))
        return TrainState(run_id=run_id, branch=branch, run_dir=str(run_dir.resolve()))
    if work.universal:
        state = TrainState(**_load_universal(cfg, session, work, tag_dir))
    else:
        state = load_checkpoint(work.engine, tag_dir, rank=session.rank)
    for change in trajectory.check(cfg, state.trajectory, work.trajectory, state.step, tag_dir, lr_at):
        if session.is_main:
            log.warning("resume: %s", change)
    session.state.resumed_from, session.state.initial_eval = str(tag_dir), state.initial_eval
    if state.step >= work.total_steps:
        # a checkpoint at the last step is not a finished run: one killed just after saving it, or resumed with
        # a train.max_steps lowered to it, still owes its final evaluation, export and summary
        if broadcast(completed_at(run_dir) if session.is_main else None) == state.step:
            raise NothingToDo(f"{run_dir} is complete at step {state.step} of {work.total_steps}")
        if session.is_main:
            log.warning(
                "resume: the checkpoint at step %d is at or past the last step (%d) but the run never finished: "
                "finishing it without training (final evaluation, export, summary)",
                state.step,
                work.total_steps,
            )
    return continue_trajectory(cfg, session, state, tag_dir)


def continue_trajectory(cfg: Config, session: Session, state: TrainState, tag_dir: Path) -> TrainState:
    """Collective, once the resume is loaded and accepted: the checkpoint directory's checkpoints that are not on the
    resumed trajectory are set aside as a branch (ds_exp.resume.branches.set_aside_branch), and the state gets this
    attempt's identity: a new branch, and a new run_id when the checkpoint is another run directory's (its files are
    never this run's to rotate)."""
    run_dir, checkpoint_dir = session.run_dir, session.run_dir / cfg.train.checkpoint_dir
    decided = None
    if session.is_main:
        here = tag_dir.parent.resolve() == checkpoint_dir.resolve()
        exports = exports_off_trajectory(run_dir / cfg.train.export_dir, run_dir, state.step, same_directory=here)
        aside = set_aside_branch(checkpoint_dir, tag_dir, run_dir, exports)
        if aside.branch is not None:
            log.warning("resume: %s", aside.message(tag_dir, run_dir, here))
        same_run = state.run_id is not None and is_same_run(tag_dir, run_dir, checkpoint_dir)
        decided = (state.run_id if same_run else _new_run_id(), _new_run_id())
    run_id, branch = broadcast(decided)
    return TrainState(**{**state.as_dict(), "run_id": run_id, "branch": branch, "run_dir": str(run_dir.resolve())})


def _load_universal(cfg: Config, session: Session, work: Workload, tag_dir: Path) -> dict[str, Any]:
    model = work.built.model
    return load_state(
        work.engine,
        tag_dir,
        rank=session.rank,
        world_size=session.world,
        seed=cfg.train.seed,
        model=model,
        groups=parameter_groups(model, cfg.optimizer.weight_decay, list(cfg.optimizer.no_decay)),
    )


def _new_run_id() -> str:
    return uuid.uuid4().hex


def train(cfg: Config, session: Session, work: Workload, start: TrainState) -> None:
    """Evaluate and generate before the first step, run the loop, evaluate and generate after the last, and
    save the final checkpoint."""
    metrics_log, trackers = session.open_sinks(start)
    progress = Progress(start.step, start.epoch, start.step_in_epoch)
    if start.step > 0:
        progress.last_save_step = start.step  # that checkpoint exists: it is never written again
    session.state.steps = start.step
    # a resumed window's sums are over all ranks: rank 0 carries them, so the reduction counts them once
    carried = (start.window_loss_sum, start.window_label_tokens) if session.is_main else (0.0, 0.0)
    metrics = Metrics(
        metrics_log,
        trackers,
        device=work.engine.device,
        world_size=session.world,
        peak_flops=work.peak_flops,
        carried=carried,
    )
    generations = Generations(
        _prompts(cfg),
        tokenizer=work.tokenizer,
        template=first_template(work.data.stats),
        max_new_tokens=int(cfg.eval.max_new_tokens),
        stop_ids=_stop_ids(cfg, work.tokenizer),
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
            **trackers.ids(),  # wandb_run_id, mlflow_run_id: a resume continues the same tracker runs
            "settings": work.settings,
            "trajectory": work.trajectory,
            "model_config": model_section(cfg),  # what an export of the checkpoint rebuilds the model with
        },
        extra=_stage0_names(cfg, work),
    )
    exports = RunExports(cfg, session, work, start.run_id)
    loop = Loop(cfg.train, cfg.eval, session, work, metrics, checkpoints, generations, progress, exports)
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
        totals, state = metrics.totals, session.state
        state.train_seconds, state.train_tokens = totals.seconds, totals.tokens
        state.train_samples, state.train_flops = totals.samples, totals.flops
        state.skipped_steps, state.train_loss = totals.skipped_steps, totals.last_loss


def _stage0_names(cfg: Config, work: Workload) -> dict[str, Any] | None:
    """A ZeRO-0 checkpoint's optimizer state is indexed by number: the parameter names of each index, recorded so that
    `python -m ds_exp.universal` can convert it without building the model (ZeRO 1-3 record their own)."""
    if work.zero_stage != 0:
        return None

    model = work.built.model
    groups = parameter_groups(model, cfg.optimizer.weight_decay, list(cfg.optimizer.no_decay))
    return {PARAM_NAMES_KEY: param_names(model, groups)}


def _prompts(cfg: Config) -> list[str]:
    return load_prompts(cfg.eval)


def _stop_ids(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return stop_token_ids(tokenizer, cfg.data.end_of_conversation_token)
