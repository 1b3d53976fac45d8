"""Where metric lines go: metrics.jsonl and the wandb run (rank 0 only; a no-op on the other ranks)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ds_exp.artifacts.summary import RESUMABLE_ENDS
from ds_exp.config.schema import Config, as_dict, plain
from ds_exp.config.secrets import redact
from ds_exp.core.files import append_json_line

log = logging.getLogger(__name__)


class MetricsLog:
    """One JSON object per line in <run dir>/metrics.jsonl (rank 0 writes; other ranks hold a disabled log)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled
        self._file = path.open("a", buffering=1) if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            append_json_line(self._file, record)

    def close(self, status: str | None = None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class WandbRun:
    """A wandb run on rank 0 when logger.wandb.mode is not disabled; a no-op everywhere else."""

    def __init__(self, cfg: Config, run_dir: Path, *, enabled: bool, run_id: str | None) -> None:
        self.run = None
        self.run_id = run_id
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
        self.run = wandb.init(
            project=wandb_cfg.project,
            entity=wandb_cfg.entity,
            group=wandb_cfg.group or cfg.experiment_name,
            name=wandb_cfg.name or run_dir.name,
            tags=[*tags, *wandb_cfg.tags],
            dir=str(wandb_cfg.dir or run_dir),
            mode=mode,
            id=run_id,  # set when resuming: the same wandb run continues
            resume="allow",
            config=redact(as_dict(cfg)),
            # logger.wandb.api_key goes to wandb's settings, not its config (else wandb reads WANDB_API_KEY or
            # ~/.netrc); an offline run writes it nowhere (tests/test_security.py)
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
            self.run.log({key: wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])}, step=step)

    def close(self, status: str) -> None:
        """Record how the run ended and finish the wandb run (a failed exit code unless it can be resumed)."""
        if self.run is not None:
            self.run.summary["status"] = status
            self.run.finish(exit_code=0 if status in RESUMABLE_ENDS else 1)
            self.run = None
