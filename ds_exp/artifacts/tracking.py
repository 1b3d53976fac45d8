"""Where metric lines go: metrics.jsonl and the trackers (rank 0 only; a no-op on the other ranks).

The trackers are wandb (logger.wandb.mode), TensorBoard (logger.tensorboard.enabled) and MLflow
(logger.mlflow.enabled; ds_exp/artifacts/mlflow_run.py), any number at once: `logger=[wandb,tensorboard,mlflow]`.
`Trackers` is what the loop sees: one `log`, `table` and `close` for all of them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_exp.artifacts.mlflow_run import MlflowRun
from ds_exp.config.logger_checks import WANDB_DEFAULT_URL, without_passwords
from ds_exp.config.schema import Config, as_dict, plain
from ds_exp.config.secrets import redact, redact_text
from ds_exp.core.files import append_json_line, json_text, write_text_atomic
from ds_exp.core.status import RESUMABLE_ENDS, RunStatus
from ds_exp.core.waits import announced
from ds_exp.resume.store import TrainState

if TYPE_CHECKING:
    from tensorboardX import SummaryWriter

log = logging.getLogger(__name__)


class MetricsLog:
    """One JSON object per line in <run dir>/metrics.jsonl (rank 0 writes; other ranks hold a disabled log)."""

    def __init__(self, path: Path, enabled: bool, start_step: int = 0) -> None:
        self.path = path
        self.enabled = enabled
        if enabled and start_step:
            drop_lines_after(path, start_step)
        self._file = path.open("a", buffering=1) if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            append_json_line(self._file, record)

    def close(self, status: RunStatus | None = None, summary: dict[str, Any] | None = None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def drop_lines_after(path: Path, step: int) -> Path | None:
    """A run resumed from the checkpoint at `step`: the lines an earlier attempt wrote past it (it was killed after
    that checkpoint) leave `path`, so that it holds one line per step of the course the run followed. They are
    kept, not lost: moved to attempts/<time>/<name> beside it (returned)."""
    if not path.is_file():
        return None
    keep: list[str] = []
    past: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            after = int(json.loads(line).get("step", 0)) > step
        except (ValueError, TypeError, AttributeError):
            after = False  # not a metric line of ours (a cut-short last line): kept as it is
        (past if after else keep).append(line)
    if not past:
        return None
    aside = path.parent / "attempts" / time.strftime("%Y-%m-%d_%H-%M-%S") / f"{path.stem}.after_step{step}.jsonl"
    aside.parent.mkdir(parents=True, exist_ok=True)
    aside.write_text("".join(past), encoding="utf-8")
    write_text_atomic(path, "".join(keep))
    log.info("resume from step %d: %d line(s) of %s past it moved to %s", step, len(past), path.name, aside)
    return aside


class WandbRun:
    """A wandb run on rank 0 when logger.wandb.mode is not disabled; a no-op everywhere else."""

    finish_bound = "it waits until the data is uploaded; Ctrl-C leaves the rest to `wandb sync` (the run's wandb/)"

    def __init__(self, cfg: Config, run_dir: Path, *, enabled: bool, run_id: str | None, start_step: int = 0) -> None:
        self.run = None
        self.run_id = run_id
        self.online, self.server = False, ""
        wandb_cfg = cfg.logger.wandb
        mode = plain(wandb_cfg.mode)
        if not enabled or mode == "disabled":
            return
        import wandb

        tags = [
            f"zero{cfg.zero.stage}",
            str(plain(cfg.precision.dtype)),
            cfg.model.name,
        ]
        # from the checkpoint's step: wandb's rewind sets aside what a killed attempt logged past it, as
        # metrics.jsonl does (wandb >= 0.17.1; its "resume" would keep those steps and drop the resumed ones)
        resuming: dict[str, Any] = (
            {"resume_from": f"{run_id}?_step={start_step}"} if run_id and start_step else {"resume": "allow"}
        )
        # online: a server (checked before the run built anything, ds_exp.config.logger_checks); said while it waits
        self.online = mode == "online"
        self.server = without_passwords(os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL)
        bound = "wandb gives up after its init_timeout, 90 s unless set"
        waiting = announced(f"wandb's server {self.server}", bound=bound) if self.online else contextlib.nullcontext()
        with waiting:
            self.run = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                group=wandb_cfg.group or cfg.experiment_name,
                name=wandb_cfg.name or run_dir.name,
                tags=[*tags, *map(redact_text, wandb_cfg.tags)],  # a tag may hold a secret by its shape
                dir=str(wandb_cfg.dir or run_dir),
                mode=mode,
                id=run_id,  # set when resuming: the same wandb run continues
                **resuming,
                config=redact(as_dict(cfg)),
                # logger.wandb.api_key goes to wandb's settings, not its config (else wandb reads WANDB_API_KEY or
                # ~/.netrc); an offline run writes it nowhere (tests/integration/test_security.py)
                settings=wandb.Settings(api_key=wandb_cfg.api_key) if wandb_cfg.api_key else None,
            )
        self.run_id = self.run.id

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        """Rows of equal keys as a wandb Table (e.g. the generations of one evaluation)."""
        if self.run is not None and rows:
            import wandb

            columns = list(rows[0])
            header: list[str | int] = [*columns]
            self.run.log({key: wandb.Table(columns=header, data=[[r[c] for c in columns] for r in rows])}, step=step)

    def close(self, status: RunStatus, summary: dict[str, Any] | None = None) -> None:
        """Record how the run ended and finish the wandb run (a failed exit code unless it can be resumed)."""
        if self.run is not None:
            self.run.summary["status"] = status
            # online: wandb uploads what is left and waits for its server (as long as it takes, unless
            # finish_timeout is set): said while it does
            waiting = (
                announced(f"wandb's server to take the run's last data ({self.server})", bound=self.finish_bound)
                if self.online
                else contextlib.nullcontext()
            )
            with waiting:
                self.run.finish(exit_code=0 if status in RESUMABLE_ENDS else 1)
            self.run = None


class TensorBoardRun:
    """TensorBoard event files (tensorboardX) in logger.tensorboard.dir, else <run dir>/tensorboard, on rank 0.

    A resume from the checkpoint at step S opens the writer with purge_step S + 1: TensorBoard then hides what an
    attempt killed after that checkpoint wrote past it, so each step is shown once, as the resumed run logged it.
    """

    def __init__(self, cfg: Config, run_dir: Path, *, enabled: bool, start_step: int = 0) -> None:
        self.writer: SummaryWriter | None = None
        self.last_step = start_step
        settings = cfg.logger.tensorboard
        if not enabled or not settings.enabled:
            return
        from tensorboardX import SummaryWriter

        self.dir = Path(settings.dir).expanduser() if settings.dir else run_dir / "tensorboard"
        # tensorboardX names a file by the second and the host and opens it with "wb": two attempts within one
        # second would overwrite; the suffix keeps them apart and in order (TensorBoard reads files sorted by name)
        self.writer = SummaryWriter(
            logdir=str(self.dir),
            purge_step=start_step + 1 if start_step else None,
            filename_suffix=f".step{start_step:09d}.{os.getpid()}",
        )
        if not start_step:
            config = json_text(redact(as_dict(cfg)), indent=2)
            self.writer.add_text("config", f"```\n{config}\n```", 0)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.writer is None:
            return
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.last_step = max(self.last_step, step)

    def table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        """Rows (the generations of one evaluation) as a Markdown table in TensorBoard's text tab."""
        if self.writer is None or not rows:
            return
        columns = list(rows[0])
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
        self.writer.add_text(key, "\n".join(lines), step)

    def close(self, status: RunStatus, summary: dict[str, Any] | None = None) -> None:
        if self.writer is None:
            return
        if summary is not None:
            text = json_text(redact(summary), indent=2)
            self.writer.add_text("summary", f"```\n{text}\n```", self.last_step)
        self.writer.close()
        self.writer = None


class Trackers:
    """Every tracker of the run behind one interface: what the metric lines, evaluations and checkpoints use."""

    def __init__(self, cfg: Config, run_dir: Path, *, enabled: bool, start: TrainState) -> None:
        step = int(getattr(start, "step", 0) or 0)
        self.all: list[MlflowRun | TensorBoardRun | WandbRun] = []
        try:  # the one most likely to refuse (a tracking store) first; any refusal closes those already open
            self.mlflow = MlflowRun(
                cfg, run_dir, enabled=enabled, run_id=getattr(start, "mlflow_run_id", None), start_step=step
            )
            self.all.append(self.mlflow)
            self.tensorboard = TensorBoardRun(cfg, run_dir, enabled=enabled, start_step=step)
            self.all.append(self.tensorboard)
            self.wandb = WandbRun(
                cfg, run_dir, enabled=enabled, run_id=getattr(start, "wandb_run_id", None), start_step=step
            )
            self.all.append(self.wandb)
        except BaseException:
            self.close(RunStatus.FAILED)
            raise

    @property
    def run_id(self) -> str | None:
        """The wandb run's id (what checkpoints have always recorded as wandb_run_id)."""
        return self.wandb.run_id

    def ids(self) -> dict[str, str | None]:
        """What a checkpoint's marker keeps so that a resume continues the same tracker runs."""
        return {"wandb_run_id": self.wandb.run_id, "mlflow_run_id": self.mlflow.run_id}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for tracker in self.all:
            tracker.log(metrics, step)

    def table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        for tracker in self.all:
            tracker.table(key, rows, step)

    def close(self, status: RunStatus, summary: dict[str, Any] | None = None) -> None:
        """Each tracker ends however the others fare: one failing to close never hides the run's own outcome."""
        for tracker in self.all:
            try:
                tracker.close(status, summary)
            except Exception as err:
                log.error("could not close %s: %s", type(tracker).__name__, err)
