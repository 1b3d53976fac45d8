"""What a run leaves behind for people: metrics.jsonl, summary.json and the wandb run (rank 0 only)."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ds_exp.config.schema import plain

log = logging.getLogger(__name__)

# Keys that hold credentials ("api_key", "hf_token", "password", ...), not ones that merely mention tokens
# ("tokenizer", "end_of_conversation_token").
_SECRET_KEY = re.compile(
    r"api[_-]?key|access[_-]?key|^token$|(auth|access|hf|hub|api|bearer|secret|session|refresh)[_-]?token$"
    r"|secret|passw(or)?d|credential",
    re.IGNORECASE,
)
REDACTED = "<redacted>"
_MIN_SECRET_LEN = 6  # shorter values would redact ordinary words
_secrets: set[str] = set()


def is_secret_key(key: object) -> bool:
    return bool(_SECRET_KEY.search(str(key)))


def redact(tree: Any) -> Any:
    """Blank every value whose key looks like a secret: configs are saved and sent to wandb."""
    if isinstance(tree, dict):
        return {k: (REDACTED if is_secret_key(k) and v is not None else redact(v)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    return tree


def register_secrets(tree: Any = None, environ: dict[str, str] | None = None) -> None:
    """Remember the secret values of a config tree and of the environment (WANDB_API_KEY, HF_TOKEN, ...), so
    that `redact_text` can blank them wherever they would be printed (DeepSpeed logs its whole config)."""

    def walk(node: Any, secret: bool) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, secret or is_secret_key(key))
        elif isinstance(node, list):
            for value in node:
                walk(value, secret)
        elif secret and isinstance(node, str) and len(node) >= _MIN_SECRET_LEN:
            _secrets.add(node)

    walk(tree, False)
    walk({k: v for k, v in (environ or {}).items() if is_secret_key(k)}, True)


def redact_text(text: str) -> str:
    for value in _secrets:
        if value in text:
            text = text.replace(value, REDACTED)
    return text


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary name and rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, payload: Any) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")


class MetricsLog:
    """One JSON object per line in <run dir>/metrics.jsonl (rank 0 writes; other ranks hold a disabled log)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled
        self._file = path.open("a", buffering=1) if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, default=float) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class WandbRun:
    """A wandb run on rank 0 when logger.wandb.mode is not disabled; a no-op everywhere else."""

    def __init__(self, cfg: DictConfig, run_dir: Path, *, enabled: bool, run_id: str | None) -> None:
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
            config=redact(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)),
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

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            for key, value in values.items():
                self.run.summary[key] = value

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
