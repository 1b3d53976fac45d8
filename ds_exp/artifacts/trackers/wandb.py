"""Weights & Biases on rank 0 (logger.wandb.mode online or offline). A resume continues the checkpoint's wandb run,
rewound to its step; each wait on an online server is announced (ds_exp.core.waits)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path
from typing import Any

import wandb

from ds_exp.artifacts.summary import shown_path
from ds_exp.artifacts.trackers.base import TrackedRun, Tracker
from ds_exp.config.schema import plain
from ds_exp.config.secrets import redact, redact_text
from ds_exp.config.trackers import WANDB_DEFAULT_URL, WandbConfig, without_passwords
from ds_exp.core.files import disk_free_bytes
from ds_exp.core.status import RESUMABLE_ENDS, RunStatus
from ds_exp.core.waits import announced

log = logging.getLogger(__name__)
FULL = 4096  # bytes free under which a disk counts as full (less than a page: nothing more can be written)


class WandbRun(Tracker):
    name = "wandb"
    finish_bound = "it waits until the data is uploaded; Ctrl-C leaves the rest to `wandb sync` (the run's wandb/)"

    def __init__(self, wandb_cfg: WandbConfig, run: TrackedRun, *, run_id: str | None, start_step: int) -> None:
        mode = plain(wandb_cfg.mode)
        tags = [f"zero{run.zero_stage}", run.precision, run.model]
        # wandb's rewind (>= 0.17.1) sets aside what a killed attempt logged past the checkpoint ("resume" would not)
        resuming: dict[str, Any] = (
            {"resume_from": f"{run_id}?_step={start_step}"} if run_id and start_step else {"resume": "allow"}
        )
        self.online = mode == "online"
        self.server = without_passwords(os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL)
        bound = "wandb gives up after its init_timeout, 90 s unless set"
        waiting = announced(f"wandb's server {self.server}", bound=bound) if self.online else contextlib.nullcontext()
        with waiting:
            self.run: Any = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                group=wandb_cfg.group or run.experiment,
                name=wandb_cfg.name or run.run_dir.name,
                tags=[*tags, *map(redact_text, wandb_cfg.tags)],  # a tag may hold a secret by its shape
                dir=str(wandb_cfg.dir or run.run_dir),
                mode=mode,
                id=run_id,  # set when resuming: the same wandb run continues
                **resuming,
                config=redact(run.params),
                # the api_key to wandb's settings, not its config; silent: wandb's banner and history stay off the
                # console (the line below says where the run is)
                settings=wandb.Settings(silent=True, api_key=wandb_cfg.api_key or None),
            )
        self.run_id = self.run.id
        self.store = Path(self.run.dir).parent  # <dir>/wandb/<run>/ (its files/ and the .wandb record)
        if self.online:
            log.info("wandb: run %s", self.run.url or self.run.id)
        else:
            log.info("wandb: an offline run; upload it with: wandb sync %s", shown_path(self.store))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)
            # wandb's service loses what a full disk refuses without a word: the disk is looked at instead
            if self.store is not None and disk_free_bytes(self.store) < FULL:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.store))

    def table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        """Rows of equal keys as a wandb Table (e.g. the generations of one evaluation)."""
        if self.run is not None and rows:
            columns = list(rows[0])
            header: list[str | int] = [*columns]
            self.run.log({key: wandb.Table(columns=header, data=[[r[c] for c in columns] for r in rows])}, step=step)

    def artifact(self, name: str, document: dict[str, Any]) -> None:
        """Nothing: the wandb run keeps its own summary (the last metrics), and `close` records the run's status."""

    def close(self, status: RunStatus) -> None:
        """Record how the run ended and finish the wandb run (a failed exit code unless it can be resumed)."""
        if self.run is not None:
            run, self.run = self.run, None
            run.summary["status"] = status
            waiting = (  # online: wandb uploads what is left, waiting on its server as long as it takes
                announced(f"wandb's server to take the run's last data ({self.server})", bound=self.finish_bound)
                if self.online
                else contextlib.nullcontext()
            )
            with waiting:
                run.finish(exit_code=0 if status in RESUMABLE_ENDS else 1)

    def abandon(self) -> None:
        """Stop logging (its disk is full); wandb's service ends the run when the process does."""
        run, self.run = self.run, None
        if run is not None:
            with contextlib.suppress(Exception):
                run.finish(exit_code=1)
