"""Where ds_exp finds its own files, in a checkout and after `pip install .` alike."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # ds_exp/


def conf_dir() -> Path:
    """conf/ at the top of a checkout, or the copy installed as the package data `ds_exp/conf`."""
    for candidate in (PACKAGE_DIR.parent / "conf", PACKAGE_DIR / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"ds_exp's conf/ directory was not found next to {PACKAGE_DIR}")


def embedded_tokenizer_dir() -> Path:
    return PACKAGE_DIR / "assets" / "tokenizer"


def user_cache_dir() -> Path:
    """ds_exp's cache of this user: $XDG_CACHE_HOME/ds_exp (if absolute), else ~/.cache/ds_exp."""
    xdg = Path(os.path.expanduser(os.environ.get("XDG_CACHE_HOME") or "~/.cache"))
    return (xdg if xdg.is_absolute() else Path.home() / ".cache") / "ds_exp"


def data_cache_dir(cache_dir: str | None) -> Path:
    """Where data.cache_dir puts the tokenized data: null = user_cache_dir()/data; else the path, expanded."""
    if cache_dir is None:
        return user_cache_dir() / "data"
    return Path(os.path.expandvars(os.path.expanduser(cache_dir)))


def not_a_directory(path: Path) -> Path | None:
    """`path`, or its nearest existing ancestor, when that is not a directory (so no directory can be made there)."""
    for candidate in (path, *path.absolute().parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def sweep_job_names(sweep_dir: Path) -> list[str]:
    """The jobs a sweep directory already holds (each job directory has its .hydra/config.yaml)."""
    return sorted(p.parent.parent.name for p in sweep_dir.glob("*/.hydra/config.yaml"))
