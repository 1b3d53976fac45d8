"""A Hugging Face hub id on a machine that cannot reach the hub (one short TCP probe, or HF_HUB_OFFLINE=1 /
TRANSFORMERS_OFFLINE=1): a cached id loads offline, another is refused at once, not after ~50 s of retries per file."""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

from ds_exp.config.model_checks import looks_like_local_path
from ds_exp.config.schema import ModelConfig
from ds_exp.core.errors import ConfigError
from ds_exp.launch.environment import launch_rank_from_env

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = ("1", "true", "yes", "on")


def hub_ids(model: ModelConfig) -> list[tuple[str, str]]:
    """(key, id) of the model settings that name a hub repository."""
    out = []
    for key, value in (("model.name_or_path", model.name_or_path), ("model.tokenizer", model.tokenizer)):
        if value and not looks_like_local_path(str(value)) and (key, value) not in out:
            out.append((key, str(value)))
    return out


def offline_settings() -> list[str]:
    """The variables that keep huggingface_hub offline here, as set (`HF_HUB_OFFLINE=1`)."""
    return [
        f"{name}={os.environ[name].strip()}"
        for name in OFFLINE_VARIABLES
        if os.environ.get(name, "").strip().lower() in _TRUE
    ]


def offline() -> bool:
    return bool(offline_settings())


def hf_cache(variable: str, folder: str) -> Path:
    """A Hugging Face library's cache folder, by its own rules (`variable`, else HF_HOME/`folder`, XDG_CACHE_HOME)."""
    if os.environ.get(variable):
        return Path(os.environ[variable]).expanduser()
    default_home = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "huggingface"
    return Path(os.environ.get("HF_HOME", default_home)).expanduser() / folder


def hub_cache() -> Path:
    return hf_cache("HF_HUB_CACHE", "hub")


def cached(repo_id: str, kind: str = "models") -> bool:
    """A snapshot of the hub repository is in the local cache (what an offline load can use)."""
    snapshots = hub_cache() / f"{kind}--{repo_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(p.is_dir() and any(p.iterdir()) for p in snapshots.iterdir())


def hub_address() -> tuple[str, int, str]:
    """(host, port, what) of the first hop to the hub: the HTTPS proxy if one is set, else HF_ENDPOINT's host."""
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        if os.environ.get(name):
            url = urlsplit(os.environ[name] if "://" in os.environ[name] else "http://" + os.environ[name])
            return url.hostname or "", url.port or 3128, f"the proxy {name}={url.hostname}:{url.port or 3128}"
    url = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (80 if url.scheme == "http" else 443)
    return url.hostname or "", port, f"{url.hostname}:{port}"


def unreachable(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why (host, port) cannot be reached within `timeout` seconds (the DNS lookup runs in a thread: it can hang)."""
    result: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as err:
            result.append(err.strerror or type(err).__name__)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else f"no answer in {timeout:g} s"


def plans_from_arch(model: ModelConfig, *, dry_run: bool) -> bool:
    """A dry run of an uncached hub model whose preset carries model.arch plans from those numbers."""
    ids = hub_ids(model)
    return bool(dry_run and model.arch and model.name_or_path and ids) and not all(cached(repo) for _, repo in ids)


def check_hub(model: ModelConfig, *, dry_run: bool) -> None:
    """Raise ConfigError for hub ids that cannot be loaded here; load cached ones offline when the hub is away."""
    ids = hub_ids(model)
    if not ids or plans_from_arch(model, dry_run=dry_run):  # a dry run that needs no file of the model
        return
    missing = [(key, repo) for key, repo in ids if not cached(repo)]
    settings = offline_settings()
    if settings:
        if missing:
            is_set = f"{' and '.join(settings)} {'is' if len(settings) == 1 else 'are'} set (the hub is not asked)"
            unset = "unset " + " and ".join(setting.partition("=")[0] for setting in settings)
            raise ConfigError([_refusal(key, repo, is_set, unset) for key, repo in missing])
        return
    host, port, what = hub_address()
    why = unreachable(host, port)
    if why is None:
        return
    if missing:
        why = f"the hub cannot be reached from here ({what}: {why})"
        raise ConfigError(
            [_refusal(key, repo, why, "fix the connection (HF_ENDPOINT, HTTPS_PROXY)") for key, repo in missing]
        )
    os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers / huggingface_hub are imported: no retries
    if launch_rank_from_env() != 0:
        return
    log.warning(
        "the Hugging Face hub cannot be reached (%s: %s): %s load from the local cache (HF_HUB_OFFLINE=1)",
        what,
        why,
        ", ".join(repo for _, repo in ids),
    )


def _refusal(key: str, repo: str, why: str, or_else: str) -> str:
    # the variable that moved the cache is named (HF_HOME set elsewhere)
    source = next((name for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME") if os.environ.get(name)), None)
    cache = f"{hub_cache()}, from {source}" if source else str(hub_cache())
    return (
        f"{key}={repo} is a Hugging Face hub id, {why}, and it is not in the local cache ({cache}); "
        f"download it where there is network (hf download {repo} --local-dir DIR) and give {key}=DIR, or {or_else}"
    )
