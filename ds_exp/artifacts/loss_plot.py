"""plots/loss.png for a run without a tracker: train and eval loss and the learning rate by step from metrics.jsonl,
drawn by rank 0 after each evaluation and at the end. A failure costs the picture, said once, never the run."""

from __future__ import annotations

import io
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_exp.core.errors import first_line
from ds_exp.core.files import no_room, write_bytes_atomic
from ds_exp.launch.run_logging import FILE_LOGGER

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)
file_log = logging.getLogger(FILE_LOGGER)

PLOT = Path("plots") / "loss.png"  # in the run directory
SHARE = 50  # a picture waits at least this many times the last one's duration after it (2% of the run at most)


@dataclass
class Curves:
    """The points of the picture, by optimizer step (NaN where a value was not finite: a gap in the line)."""

    train: list[tuple[int, float]] = field(default_factory=list)
    lr: list[tuple[int, float]] = field(default_factory=list)
    eval: list[tuple[int, float]] = field(default_factory=list)

    def add(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        if record.get("type") == "train":
            self.train.append((step, _number(record.get("loss"))))
            if record.get("lr") is not None:
                self.lr.append((step, _number(record.get("lr"))))
        elif record.get("type") == "eval":
            self.eval.append((step, _number(record.get("eval_loss"))))


def _number(value: object) -> float:
    """A value of a metric line as a float; null (a non-finite value, ds_exp/core/files.py) as NaN."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


class LossPlot:
    """<run dir>/plots/loss.png, redrawn by `draw` (a no-op unless enabled: rank 0)."""

    def __init__(self, run_dir: Path, *, enabled: bool, title: str | None = None) -> None:
        self.metrics, self.path = run_dir / "metrics.jsonl", run_dir / PLOT
        self.enabled = enabled
        self.title = title or f"{run_dir.parent.name}/{run_dir.name}"
        self.curves = Curves()
        self.read_to = 0  # bytes of metrics.jsonl read so far (only whole lines)
        self.drawn_to = 0  # read_to when the picture was last drawn
        self.next_at = 0.0  # time.perf_counter() before which an evaluation's picture is skipped

    def draw(self, final: bool = False) -> None:
        """The picture of metrics.jsonl now, unless nothing is new; an evaluation's (not `final`) only when due."""
        started = time.perf_counter()
        if not self.enabled or (started < self.next_at and not final):
            return
        try:
            self.read_new_lines()
            if self.read_to == self.drawn_to:
                return
            png = render(self.curves, self.title)
            self.path.parent.mkdir(exist_ok=True)
            write_bytes_atomic(self.path, png)
            self.drawn_to = self.read_to
        except Exception as err:  # the picture's loss alone
            self.enabled = False
            # a full disk stops the run at its next metric line, with the one message that names it: the log file's
            say = file_log.info if no_room(err) else log.warning
            say("%s was not drawn (%s); metrics.jsonl has every line", self.path, no_room(err) or first_line(err))
            return
        took = time.perf_counter() - started
        self.next_at = started + SHARE * took
        file_log.info("%s drawn in %.3f s", self.path, took)

    def read_new_lines(self) -> None:
        """The lines metrics.jsonl gained since the last picture; all again when a resume rewrote it shorter."""
        if not self.metrics.is_file():
            return
        with self.metrics.open("rb") as file:
            if file.seek(0, io.SEEK_END) < self.read_to:
                self.curves, self.read_to, self.drawn_to = Curves(), 0, -1
            file.seek(self.read_to)
            data = file.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next picture
        self.read_to += len(whole)
        for line in whole.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # not a line of ours (a cut-short line of a killed attempt)
            if isinstance(record, dict):
                self.curves.add(record)


def render(curves: Curves, title: str) -> bytes:
    out = io.BytesIO()
    figure(curves, title).savefig(out, format="png")
    return out.getvalue()


def figure(curves: Curves, title: str) -> Figure:
    """Loss on the left axis, learning rate on the right from 0; a short series as points, evaluations labelled."""
    # imported by the first picture (a second), not by every import of the training stack

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    drawing = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(drawing)
    loss_axis = drawing.add_subplot()
    lines = []
    if curves.train:
        steps, values = zip(*curves.train, strict=True)
        lines += loss_axis.plot(steps, values, color="tab:blue", linewidth=1.2, label="train loss", **_style(steps))
    if curves.eval:
        steps, values = zip(*curves.eval, strict=True)
        lines += loss_axis.plot(steps, values, color="tab:orange", label="eval loss", **_style(steps, size=6))
        if len(steps) <= EVAL_LABELS:
            last = max(steps)
            for step, value in curves.eval:  # the last one's to its left: the axis ends there
                if math.isfinite(value):
                    right = step < last or step == 0
                    loss_axis.annotate(f"{value:.3f}", (step, value), xytext=(6 if right else -6, 6),
                                       textcoords="offset points", ha="left" if right else "right",
                                       color="tab:orange", fontsize=8)  # fmt: skip
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("loss")
    loss_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    loss_axis.margins(y=0.1)  # room for an evaluation's label above its point
    loss_axis.grid(alpha=0.3)
    if curves.lr:
        lr_axis = loss_axis.twinx()
        steps, values = zip(*curves.lr, strict=True)
        lr_style = {"color": "tab:gray", "linewidth": 1, "linestyle": "--", **_style(steps)}
        lines += lr_axis.plot(steps, values, label="learning rate", **lr_style)
        peak = max((v for v in values if math.isfinite(v)), default=0.0)
        lr_axis.set_ylim(0, peak * 1.08 if peak > 0 else 1)
        lr_axis.set_ylabel("learning rate")
        lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if lines:  # above the axes, where it hides no point
        labels = [str(line.get_label()) for line in lines]
        loss_axis.legend(lines, labels, loc="lower left", bbox_to_anchor=(0, 1), ncol=3, frameon=False, fontsize=9)
    else:
        loss_axis.text(0.5, 0.5, "no metric line yet", ha="center", va="center", transform=loss_axis.transAxes)
    drawing.suptitle(title, fontsize=10)
    drawing.subplots_adjust(left=0.09, right=0.88, top=0.86, bottom=0.12)
    return drawing


EVAL_LABELS = 8  # evaluations up to this many are labelled with their loss
FEW_POINTS = 30  # a series of fewer points shows each one


def _style(steps: tuple[int, ...], size: float = 3) -> dict[str, Any]:
    """Points alone for one or two (a line through two is a trend nobody measured), else a line (dotted if short)."""
    if len(steps) <= 2:
        return {"marker": "o", "markersize": size + 1, "linestyle": "none"}
    return {"marker": "o", "markersize": size} if len(steps) < FEW_POINTS else {}
