"""The run's metric lines, every train.log_every steps: metrics.jsonl, the trackers, the progress bar (piped: a plain
line every tenth of the run) and the step log. A window's all-reduce is awaited at the next step, so no rank waits."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ds_exp.artifacts.summary import duration
from ds_exp.artifacts.tracking import MetricsLog, Trackers
from ds_exp.launch.run_logging import STEP_LOGGER, on_terminal
from ds_exp.runtime.process_group import all_reduce_sum
from ds_exp.train.step import SFT, Objective, StepResult

log = logging.getLogger(__name__)
step_log = logging.getLogger(STEP_LOGGER)


@dataclass
class Window:
    """This rank's sums since the last metric line."""

    # a tensor once a step has run: read (a device sync on GPUs) only when the line is written
    loss_sum: torch.Tensor | float = 0.0
    label_tokens: float = 0.0
    input_tokens: float = 0.0
    samples: float = 0.0
    flops: float = 0.0
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)
    flops_row_attention: float = 0.0  # torchtitan's / llm-foundry's count (ds_exp.train.flops)
    sums: list[torch.Tensor | float] = field(default_factory=list)  # the objective's more sums (Objective.sums)


@dataclass
class PendingLine:
    """A closed window whose sums over ranks are still being all-reduced."""

    work: dist.Work  # the async all-reduce
    sums: torch.Tensor  # its tensor: loss sum, label tokens, input tokens, samples, model FLOPs (both counts)
    record: dict[str, Any]  # the line, less what the sums give
    elapsed: float


@dataclass
class Totals:
    """Over the whole run (this process's part of it), for summary.json."""

    seconds: float = 0.0  # wall time of the optimizer steps
    tokens: float = 0.0  # over all ranks, from the written lines
    samples: float = 0.0
    flops: float = 0.0
    skipped_steps: int = 0
    last_loss: float | None = None
    flops_row_attention: float = 0.0


class _NoBar:
    """The progress bar until `Metrics.show_progress` draws one (evaluations before training draw none)."""

    def update(self, n: int) -> None: ...

    def set_postfix(self, values: dict[str, str], refresh: bool = True) -> None: ...

    def close(self) -> None: ...


class PlainProgress:
    """The bar's news as plain lines where the console is no terminal: every tenth of the run and every `every_s`."""

    def __init__(self, total: int, initial: int, every_s: float = 60.0) -> None:
        self.total, self.initial, self.every_s = total, initial, every_s
        self.started = self.said_at = time.perf_counter()
        self.said_tenth = self.tenth(initial)

    def tenth(self, step: int) -> int:
        return step * 10 // max(self.total, 1)

    def due(self, step: int) -> bool:
        return self.tenth(step) > self.said_tenth or time.perf_counter() - self.said_at >= self.every_s

    def line(self, step: int, shown: dict[str, str]) -> str:
        said = (("loss", "loss {}"), ("lr", "lr {}"), ("tok_s", "{} tokens/s"), ("mfu", "MFU {}"))
        values = [form.format(shown[key]) for key, form in said if key in shown]
        return f"step {self.progress(step)}: {', '.join(values) or 'running'}{self.left(step)}"

    def progress(self, step: int) -> str:
        """`50/250 (20%)`, said now: the next line is due a tenth of the run, or every_s, later."""
        self.said_at, self.said_tenth = time.perf_counter(), self.tenth(step)
        return f"{step}/{self.total} ({100 * step // max(self.total, 1)}%)"

    def left(self, step: int) -> str:
        """`; about 1m 40s left` at the pace since the start ("" when too soon to tell, or done)."""
        done = step - self.initial
        if done <= 0 or step >= self.total:
            return ""
        left = (time.perf_counter() - self.started) / done * (self.total - step)
        return f"; about {duration(left)} left" if left >= 1 else ""


class Metrics:
    """See the module docstring. `metrics_log`, `wandb`: ds_exp.artifacts.tracking's sinks."""

    def __init__(
        self,
        metrics_log: MetricsLog,
        wandb: Trackers,
        *,
        device: torch.device,
        world_size: int,
        peak_flops: float | None,
        carried: tuple[float, ...] = (0.0, 0.0),  # loss sum, label tokens, the objective's sums
        objective: Objective = SFT,
    ) -> None:
        self.metrics_log, self.wandb = metrics_log, wandb
        self.bar: tqdm | _NoBar = _NoBar()
        self.device, self.world_size, self.peak_flops = device, world_size, peak_flops
        self.objective = objective
        # a resumed window's sums (over all ranks: rank 0 alone carries them)
        self.window = self.new_window(carried[0], carried[1], list(carried[2:]))
        self.pending: PendingLine | None = None
        self.totals = Totals()
        self.skips_said = 0  # skipped steps the log has warned about
        self.shown: dict[str, str] = {}  # what the bar shows besides its count: loss, lr, tok_s, mfu
        self.loss_step = 0  # the step whose loss the bar shows
        self.plain: PlainProgress | None = None  # the bar's lines when the console is not a terminal

    def new_window(self, loss_sum: float = 0.0, labels: float = 0.0, sums: list[float] | None = None) -> Window:
        carried: list[torch.Tensor | float] = list(sums or [0.0] * len(self.objective.sums))
        return Window(loss_sum, labels, sums=carried)

    def show_progress(self, total: int, initial: int, enabled: bool) -> None:
        """The progress of the training steps (rank 0), from here on: a bar on a terminal, plain lines elsewhere."""
        drawn = enabled and on_terminal()
        self.plain = PlainProgress(total, initial) if enabled and not drawn else None
        self.bar = tqdm(
            total=total, initial=initial, desc="train", disable=not drawn, dynamic_ncols=True, mininterval=1.0
        )

    def close_progress(self) -> None:
        self.bar.close()

    def show_step_loss(self, step: int, loss: float) -> None:
        """The loss of optimizer step `step` on the bar: at once the first time, then with the bar's next refresh."""
        first = not self.loss_step
        self.loss_step = step
        self.show(refresh=first, loss=f"{loss:.4f}")
        self.say_progress(step)

    def say_progress(self, step: int) -> None:
        """A plain progress line, when one is due (the console is not a terminal)."""
        if self.plain is not None and self.plain.due(step):
            log.info("%s", self.plain.line(step, self.shown))

    def show(self, refresh: bool = True, **values: str) -> None:
        self.shown.update(values)
        self.bar.set_postfix({k: self.shown[k] for k in ("loss", "lr", "tok_s", "mfu") if k in self.shown}, refresh)

    def add(self, result: StepResult, seconds: float) -> None:
        window = self.window
        window.loss_sum = window.loss_sum + result.loss_sum
        window.label_tokens += result.label_tokens
        window.input_tokens += result.input_tokens
        window.samples += result.samples
        window.flops += result.flops
        window.flops_row_attention += result.flops_row_attention
        window.sums = [total + value for total, value in zip(window.sums, result.sums, strict=True)]
        window.steps += 1
        self.totals.seconds += seconds
        self.totals.skipped_steps += not result.applied
        self.bar.update(1)

    def close(self, fields: dict[str, Any]) -> None:
        """Close the window that ends here (`fields`: the line's step, epoch, lr, ...) and open the next."""
        self.write()
        window, now = self.window, time.perf_counter()
        self.window = self.new_window()
        self.window.started = now
        sums = torch.tensor(
            [
                float(window.loss_sum),
                window.label_tokens,
                window.input_tokens,
                window.samples,
                window.flops,
                window.flops_row_attention,
                *map(float, window.sums),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        record = {
            "type": "train",
            **fields,
            "step_time_s": (now - window.started) / max(window.steps, 1),  # wall time per optimizer step
            "skipped_steps": self.totals.skipped_steps,
        }
        work = dist.all_reduce(sums, async_op=True)
        self.pending = PendingLine(work, sums, record, max(now - window.started, 1e-9))

    def write(self) -> None:
        """Write the pending line, once its sums over ranks are there (a no-op when there is none)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.work.wait()
        loss_sum, labels, inputs, samples, flops, row_flops, *sums = pending.sums.tolist()
        totals = self.totals
        totals.tokens += inputs
        totals.samples += samples
        totals.flops += flops
        totals.flops_row_attention += row_flops
        loss = loss_sum / max(labels, 1.0)
        record = {
            **pending.record,
            "loss": loss,
            **self.objective.line(sums, labels),
            "tokens_per_s": inputs / pending.elapsed,
            "tokens_per_s_per_device": inputs / pending.elapsed / self.world_size,
            "samples_per_s": samples / pending.elapsed,
            "tflops_per_device": flops / pending.elapsed / self.world_size / 1e12,
            "mfu": self.mfu(flops, pending.elapsed),  # ds_exp's count: 6 N + each example's attention
            "mfu_with_attention": self.mfu(row_flops, pending.elapsed),  # torchtitan's: 6 N + 12 L d s per token
        }
        step = record["step"]
        if record["skipped_steps"] > self.skips_said:
            log.warning(
                "step %d: the fp16 loss scaler skipped %d steps so far (gradient overflow; the scale is lowered)",
                step,
                record["skipped_steps"],
            )
            self.skips_said = record["skipped_steps"]
        totals.last_loss = loss
        self.metrics_log.write(record)
        self.wandb.log({f"train/{k}": v for k, v in record.items() if k not in ("type", "step")}, step=step)
        shown: dict[str, str] = {"lr": f"{record['lr']:.2e}", "tok_s": f"{record['tokens_per_s']:.0f}"}
        if record["mfu"] is not None:
            shown["mfu"] = f"{record['mfu']:.1%}"
        if step > self.loss_step:  # the run's last line: no later step brings that step's own loss
            shown["loss"] = f"{loss:.4f}"
            self.show(True, **shown)
            self.say_progress(step)
        else:
            self.show(True, **shown)
        step_log.info("step %d loss %.5f lr %.3e tokens/s %.0f", step, loss, record["lr"], record["tokens_per_s"])

    def record(self, record: dict[str, Any], wandb_values: dict[str, Any]) -> None:
        """Another kind of line (an evaluation): after the pending train line, so metrics.jsonl stays in order."""
        self.write()
        self.metrics_log.write(record)
        self.wandb.log(wandb_values, step=record["step"])

    def carry(self) -> tuple[float, ...]:
        """Collective: the open window's sums over all ranks, for a checkpoint: a resumed run's next line is alike."""
        self.write()
        window = self.window
        return tuple(
            all_reduce_sum([float(window.loss_sum), window.label_tokens, *map(float, window.sums)], self.device)
        )

    def mfu(self, flops: float, seconds: float) -> float | None:
        """Model FLOPs utilization over all ranks; None where the device's peak is unknown (CPUs)."""
        if not self.peak_flops or seconds <= 0:
            return None
        return flops / seconds / (self.peak_flops * self.world_size)
