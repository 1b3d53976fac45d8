"""Where a run lands, checked before anything is written: experiment_name is a plain name (`../x` put a run outside
outputs/), and hydra.job.chdir=true does not silently move relative paths. Light: no torch, no deepspeed."""

from __future__ import annotations

import re

from ds_exp.config.model_checks import looks_like_local_path
from ds_exp.config.schema import Config


def experiment_name_problem(name: object) -> str | None:
    """experiment_name names directories and the wandb group: one plain name, never a path."""
    text = str(name)
    if text and text not in (".", "..") and not re.search(r"[/\\\x00-\x1f]", text):
        return None
    plain = re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "my_experiment"
    shown = text if text.isprintable() and text else repr(text)
    return (
        f"experiment_name={shown} is not a plain name: it names the run's directory outputs/<name>/, the sweep "
        "directory, the optuna study and the wandb group, so a path separator, `..` or an empty name would put "
        f"them elsewhere; give a name without `/`, e.g. experiment_name={plain}"
    )


_DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".gz", ".txt")


def chdir_problems(cfg: Config, chdir: bool) -> list[str]:
    """hydra.job.chdir=true runs the job inside its run directory: relative path settings would be taken from there."""
    if not chdir:
        return []
    given: list[tuple[str, str | None]] = [
        ("model.name_or_path", cfg.model.name_or_path),
        ("model.tokenizer", cfg.model.tokenizer),
        ("data.cache_dir", cfg.data.cache_dir),
        ("deepspeed.config_file", cfg.deepspeed.config_file),
        ("eval.prompts_file", cfg.eval.prompts_file),
        ("offload.nvme_path", cfg.offload.nvme_path),
        ("logger.tensorboard.dir", cfg.logger.tensorboard.dir),
        ("resume", None if cfg.resume == "auto" else cfg.resume),
    ]
    for group in ("sources", "sft_only_sources"):
        for n, source in enumerate(getattr(cfg.data, group)):
            given += [(f"data.{group}[{n}].path", source.path), (f"data.{group}[{n}].eval_path", source.eval_path)]
    moved = []
    for key, value in given:
        if not value or value.startswith(("/", "~")):
            continue
        may_be_a_hub_id = key.startswith(("model.", "data.sources", "data.sft_only_sources"))
        if not may_be_a_hub_id or looks_like_local_path(value) or value.endswith(_DATA_SUFFIXES):
            moved.append((key, value))
    uri = cfg.logger.mlflow.tracking_uri or ""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):  # sqlite:///relative.db
        moved.append(("logger.mlflow.tracking_uri", uri))
    if not moved:
        return []
    return [
        "hydra.job.chdir=true runs the job inside its run directory, so these relative paths would be read and "
        f"written there instead of where you launched it: {', '.join(f'{k}={v}' for k, v in moved)}; give them as "
        "absolute paths, or leave hydra.job.chdir=false (ds_exp needs no chdir: it writes into its run directory "
        "either way)"
    ]
