"""A run as one process sees it, and the one place its failures are handled: `Session` installs the stop signals, joins
the process group, starts the log and holds summary.json's state; leaving maps the outcome to a status."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from ds_exp.artifacts.summary import EVERY_RANK_ENDS, RunState, final_line, write_summary
from ds_exp.artifacts.trackers.base import TrackedRun
from ds_exp.artifacts.tracking import MetricsLog, Trackers, drop_lines_after
from ds_exp.config.command_line import command, override
from ds_exp.config.precision import detect_accelerator
from ds_exp.config.schema import Config, LoraConfig, as_dict
from ds_exp.config.secrets import redact_text, register_secrets
from ds_exp.core.errors import ConfigError, Diverged, DsExpError, Refused, RunFailed, first_line
from ds_exp.core.files import no_room
from ds_exp.core.status import RunStatus
from ds_exp.launch.console import traceback_logged
from ds_exp.launch.environment import LaunchInfo, detect_launch
from ds_exp.launch.lock import claim_run_dir, lock_run_dir, release_run_dir
from ds_exp.launch.run_dir import remove_rank_placeholder, remove_refused_attempt
from ds_exp.launch.run_logging import FILE_LOGGER
from ds_exp.resume.store import TrainState
from ds_exp.runtime.device import resolved_precision
from ds_exp.runtime.memory import is_out_of_memory, peak_memory_bytes
from ds_exp.runtime.ops import build_seconds
from ds_exp.runtime.peers import barrier, gather_hosts, lost_ranks
from ds_exp.runtime.process_group import broadcast, init_distributed, is_lost_peer, mark_lost_peer
from ds_exp.runtime.rank_logging import close_run_logging, setup_run_logging
from ds_exp.runtime.signals import StopSignals

log = logging.getLogger("ds_exp.train")
file_log = logging.getLogger(FILE_LOGGER)


_runs_started = [0]  # sessions this process has started


def run_started() -> float:
    """When the run began for its user: the process's start for its first run, the session's for a later job."""
    _runs_started[0] += 1
    if _runs_started[0] == 1:
        try:
            return float(psutil.Process().create_time())
        except psutil.Error:
            pass
    return time.time()


RELAUNCH = "DS_EXP_RELAUNCH"  # how a launchers/*.sh script is run again for this launch, as it was typed


def relaunch_command(launch: LaunchInfo) -> str:
    """How this launch starts ds_exp again: the launchers/ script as typed, else the launcher's own command."""
    if os.environ.get(RELAUNCH):
        return os.environ[RELAUNCH]
    if launch.world_size == 1:
        return "python -m ds_exp"
    nodes = "" if launch.local_world_size == launch.world_size else " (on each node, with its rendezvous options)"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun --nproc_per_node {launch.local_world_size}{nodes} -m ds_exp"
    if launch.launcher == "mpi":
        return f"mpirun -np {launch.world_size} python -m ds_exp"
    if launch.launcher == "slurm":
        return "srun python -m ds_exp"
    return f"the launcher that started these {launch.world_size} ranks{nodes}, with python -m ds_exp"


def in_multirun() -> bool:
    """A job of a sweep (its directory is the sweep's to report on), not a single run."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def training_line(lora: LoraConfig, ds_config: dict[str, Any], precision: str, dp: int, sp: int) -> str:
    """The console's line of what the run trains with, as DeepSpeed is given it (a user's DeepSpeed file included)."""
    zero = ds_config.get("zero_optimization") or {}
    parts = [f"ZeRO stage {zero.get('stage', 0)}", precision]
    offloaded = []
    for what, key in (("optimizer states", "offload_optimizer"), ("parameters", "offload_param")):
        block = zero.get(key) or {}
        device = str(block.get("device") or "none")
        if device != "none":
            offloaded.append(f"{what} to {device}" + (f" ({block.get('nvme_path')})" if device == "nvme" else ""))
    parts.append(f"offload {' and '.join(offloaded)}" if offloaded else "no offload")
    if sp > 1:
        parts.append(f"sequence parallel {sp} (each sample over {sp} ranks) x data parallel {dp}")
    if lora.dim:
        kinds = [name for name, on in (("DoRA", lora.use_dora), ("rsLoRA", lora.use_rslora)) if on]
        if lora.quantize:
            kinds.append(f"QLoRA ({lora.quantize} base)")
        alpha = lora.alpha if lora.alpha is not None else lora.dim
        parts.append(f"LoRA rank {lora.dim}, alpha {alpha:g}{' with ' + ' and '.join(kinds) if kinds else ''}")
    else:
        parts.append("every parameter trained (lora.dim=0)")
    return "training: " + ", ".join(parts)


class NothingToDo(Exception):
    """A resume of a run that is complete already: nothing is trained, saved, exported or rewritten."""


@dataclass
class Outcome:
    status: RunStatus
    error: str | None = None
    raise_: BaseException | None = None  # what the CLI sees next (a user error, a traceback)


class Session:
    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.cfg = cfg
        # known from the environment alone, so a failure during start-up is still reported by the right rank
        self.launch = detect_launch(cfg.dist)
        self.rank, self.world = self.launch.rank, self.launch.world_size
        self.run_dir = run_dir
        self.accelerator = detect_accelerator()
        self.precision = ""  # decided in start()
        self.signals = StopSignals(self.launch.launcher)
        self.state = RunState(
            run_dir,
            self.launch.launcher,
            self.world,
            sequence_parallel_size=int(cfg.dist.sequence_parallel_size),
            started=run_started(),
        )
        self.sinks: list[MetricsLog | Trackers] = []  # closed when the session ends
        self.hosts: list[tuple[str, list[str]]] = []  # (host, addresses) of each rank, once the group is up
        self.resume_source: Path | None = None  # the checkpoint this attempt continues (set once it is decided)
        self.built_before = build_seconds()  # ops built by an earlier job of this process are not this run's
        self.refused = False  # refused before any work: this attempt leaves nothing (finish)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __enter__(self) -> Session:
        self.signals.install()
        return self

    def start(self) -> None:
        """Join the process group; every rank works in rank 0's run directory and logs to its own file."""
        if self.accelerator != "cpu":
            self.accelerator = get_accelerator().device_name()
        backend = init_distributed(self.cfg.dist, self.launch, self.accelerator)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.run_dir = Path(broadcast(str(self.run_dir)))
        if self.world > 1:  # where each rank runs: a rank lost later is named with its host
            self.hosts = gather_hosts()
        self.state.run_dir = self.run_dir
        if self.is_main:
            lock_run_dir(self.run_dir)  # held already when Hydra's callback took it (a single run)
            claim_run_dir(self.run_dir)
        # values of credential keys, however they got into the config (a YAML file, ${oc.env:...}), and of
        # credential-named environment variables: blanked in every log line from here on
        register_secrets(as_dict(self.cfg), environ=dict(os.environ))
        self.state.log_file = str(setup_run_logging(self.run_dir, self.rank))
        self.precision = resolved_precision(self.cfg.precision.dtype, self.accelerator)
        self.state.backend, self.state.accelerator, self.state.precision = backend, self.accelerator, self.precision
        log.info(
            "launch %s: rank %d of %d on %s, rendezvous %s:%d, %s backend on %s, %d CPU threads",
            self.launch.launcher,
            self.rank,
            self.world,
            os.uname().nodename,
            os.environ.get("MASTER_ADDR", self.launch.master_addr),  # what init_distributed used
            int(os.environ.get("MASTER_PORT", self.launch.master_port)),
            backend,
            self.accelerator,
            torch.get_num_threads(),
        )

    def open_sinks(self, start: TrainState) -> tuple[MetricsLog, Trackers]:
        """metrics.jsonl and the trackers (rank 0 writes them), continuing `start`'s tracker runs on a resume."""
        run = TrackedRun.of(self.cfg, self.run_dir)
        trackers = Trackers(self.cfg.logger, run, enabled=self.is_main, start=start)
        self.sinks.append(trackers)
        start_step = int(getattr(start, "step", 0) or 0)  # a resume: the lines past it are of a killed attempt
        metrics_log = MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.is_main, start_step=start_step)
        if self.is_main and start_step:
            drop_lines_after(self.run_dir / "generations.jsonl", start_step)
        self.sinks.append(metrics_log)
        return metrics_log, trackers

    def ready(self) -> None:
        """Training can begin (data, weights, engine and checkpoint are loaded): the end of the run's load time."""
        self.state.ready_seconds = time.time() - self.state.started

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        outcome = self.outcome(exc)
        self.signals.restore()
        self.finish(outcome)
        if outcome.raise_ is not None:
            if outcome.raise_ is exc:
                return False  # propagate as it is
            raise outcome.raise_ from exc
        if outcome.status in (RunStatus.STOPPED, RunStatus.REQUEUED):
            if self.is_main:
                print(f"ds_exp: {redact_text(outcome.error or '')}", file=sys.stderr)
            self.signals.leave(self.rank)
        return True

    def outcome(self, exc: BaseException | None) -> Outcome:
        """How the run ended, in one place: the status summary.json records, its message, and what to raise."""
        if exc is None:
            return Outcome(RunStatus.COMPLETED)
        if isinstance(exc, NothingToDo):
            if self.is_main:
                print(f"ds_exp: {exc}: nothing to do; its checkpoints, export and summary are unchanged")
            return Outcome(RunStatus.UNCHANGED)
        if isinstance(exc, KeyboardInterrupt):
            return Outcome(RunStatus.INTERRUPTED, "interrupted by the user", exc)
        if isinstance(exc, Refused):  # refused before anything was loaded or trained: files stay as they were
            self.refused = not self.sinks and not in_multirun()
            return Outcome(RunStatus.UNCHANGED, f"{type(exc).__name__}: {exc}", exc)
        if isinstance(exc, DsExpError) and not self.sinks and not in_multirun():
            # refused in setup, before any training (a LoRA target that matches nothing): like a refusal at
            # validation it leaves nothing, so typos leave no stubs under outputs/. A sweep's job keeps its
            # summary.json "failed": the sweep report reads it.
            file_log.error("run refused", exc_info=exc)
            self.refused = True
            return Outcome(RunStatus.UNCHANGED, f"{type(exc).__name__}: {exc}", exc)
        where = f"step {self.state.steps}" if self.state.steps is not None else "setup"
        stopped = self.signals.behind(exc)  # a library may turn the stop into an error of its own
        if stopped is not None:
            where = (
                "submitit requeues the job, which resumes from it"
                if stopped.status == RunStatus.REQUEUED
                else f"continue it with: {self.continue_command()}"
            )
            if stopped.step is not None:
                self.state.steps = stopped.step
            return Outcome(stopped.status, f"{stopped}; {where}")
        if is_out_of_memory(exc):  # a message that says what to change; an autotune sweep records it and goes on
            first = first_line(exc)
            error = (
                f"out of memory at {where} ({first}): lower train.micro_batch_size, set "
                "model.gradient_checkpointing=true, or use a higher zero stage or offload "
                "(python -m ds_exp -m experiment=autotune finds what fits)"
            )
            self.state.error_kind = "out_of_memory"
            file_log.error("run failed", exc_info=exc)
            return Outcome(RunStatus.FAILED, error, RunFailed(error))
        reason = no_room(exc) if not isinstance(exc, DsExpError) else None
        if reason is not None:  # a full disk under any write (generations.jsonl, a data cache, ...): one message
            path = getattr(exc, "filename", None) or "a file of the run"
            error = (
                f"could not write {path} ({reason}), so the run stopped at {where}; its complete checkpoints are as "
                f"they were. Free some space, then continue it with: {self.continue_command()}"
            )
            file_log.error("run failed", exc_info=exc)
            return Outcome(RunStatus.FAILED, error, RunFailed(error))
        if isinstance(exc, Diverged):  # every rank decided it together: a failure of its own (exit status 3)
            file_log.error("run diverged", exc_info=exc)
            return Outcome(exc.status, f"{type(exc).__name__}: {exc}", exc)
        if isinstance(exc, DsExpError):  # a message for the user (printed by the CLI); the traceback in the log
            file_log.error("run failed", exc_info=exc)
            return Outcome(RunStatus.FAILED, f"{type(exc).__name__}: {exc}", exc)
        if self.world > 1 and is_lost_peer(exc):
            # a rank died or was killed: the others learn it from their next collective and leave at once
            mark_lost_peer()
            first = first_line(exc)
            lost = lost_ranks(str(exc), self.hosts, self.rank, self.world)
            error = (
                f"lost contact with {lost} at {where} ({first}): it died or was killed, see the other ranks' "
                f"logs in {self.run_dir / 'logs'}; continue from the last complete checkpoint with: "
                f"{self.continue_command()}"
            )
            file_log.error("run failed", exc_info=exc)  # the collective's own error, for the log file
            return Outcome(RunStatus.FAILED, error, RunFailed(error))
        # unexpected: the traceback goes to the rank's log, and the CLI's one line names it (launch/console.py)
        file_log.error("run failed", exc_info=exc)
        if self.state.log_file:
            traceback_logged(exc, self.state.log_file)
        return Outcome(RunStatus.FAILED, f"{type(exc).__name__}: {exc}", exc)

    def continue_command(self) -> str:
        """The command that continues this run, to paste: its launcher, the run directory and the resume."""
        resume = "resume=auto"
        if self.state.checkpoint is None and self.resume_source is not None:  # until this attempt wrote its own
            resume = override("resume", self.resume_source)
        return command(relaunch_command(self.launch), override("hydra.run.dir", self.run_dir), resume)

    def finish(self, outcome: Outcome) -> None:
        """summary.json, the sinks, the log file, the process group: whatever happened, and never hiding it."""
        self.state.status, self.state.error = outcome.status, outcome.error
        self.state.compile_seconds = build_seconds() - self.built_before
        summary = None
        try:
            if outcome.status != RunStatus.UNCHANGED:
                summary = self.write_summary()
        except OSError as err:  # e.g. a full disk: said with the run's own error, which matters more
            self.summary_not_written(outcome, err)
        for sink in self.sinks:
            sink.close(outcome.status, summary)  # the trackers keep the summary too
        close_run_logging()
        if outcome.status in (RunStatus.COMPLETED, RunStatus.UNCHANGED, Diverged.status) and dist.is_initialized():
            # The process group stays up: the next job of a multirun in this process reuses it (DeepSpeed caches
            # its groups, so a destroyed one cannot be replaced); it is torn down at exit.
            barrier("the end of the run")
        if self.rank != 0:
            remove_rank_placeholder()
        elif self.refused:  # after the barrier: every rank's log is closed
            hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
            subdir, job_log = (hydra_cfg.output_subdir, f"{hydra_cfg.job.name}.log") if hydra_cfg else (None, "")
            remove_refused_attempt(self.run_dir, subdir, job_log or "ds_exp.log")
        else:
            release_run_dir(self.run_dir)
        if summary is not None and outcome.status == RunStatus.COMPLETED:
            print(final_line(summary), flush=True)  # the last line: after the trackers' own (wandb's) and the barrier

    def summary_not_written(self, outcome: Outcome, err: OSError) -> None:
        """summary.json could not be written: the run's message says so, or one line when there is none."""
        path = self.run_dir / "summary.json"
        earlier = "; the one there is an earlier attempt's" if path.exists() else ""
        note = f"{path} was not written ({no_room(err) or err.strerror or first_line(err)}){earlier}"
        if isinstance(outcome.raise_, DsExpError) and not isinstance(outcome.raise_, ConfigError):
            outcome.raise_ = type(outcome.raise_)(f"{outcome.raise_}; {note}")
        else:
            log.error("%s", note)

    def write_summary(self) -> dict[str, Any] | None:
        """Rank 0 writes summary.json and returns it (None on the other ranks)."""
        peak = peak_memory_bytes(self.accelerator)
        peaks: list[int | None] = [peak]
        if self.state.status in EVERY_RANK_ENDS and dist.is_initialized():  # every rank is still here
            peaks = [None] * self.world
            dist.all_gather_object(peaks, peak)
        if not self.is_main:
            return None
        return write_summary(self.state, peaks)
