"""Hydra's internals ds_exp relies on (hydra-core 1.3.2-1.3.8): a sweep's jobs before launch, two hooks into every
composition and a cache of its parsed files, installed by the processes that compose, never by importing a module of
ds_exp."""

from __future__ import annotations

import copy
import functools
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

CHECKED = ((1, 3, 2), (1, 3, 8))  # the hydra-core versions the patches below were checked against


def version_problem(version: str) -> str | None:
    """What to say when ds_exp patches a Hydra it was not checked with (pyproject allows any 1.3); None when it was."""
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    if CHECKED[0] <= parts <= CHECKED[1]:
        return None
    low, high = (".".join(map(str, v)) for v in CHECKED)
    return (
        f"hydra-core {version}: ds_exp's hooks into Hydra's composition (ds_exp/core/compat/hydra.py) were checked "
        f"with {low} to {high}; if config files' credentials reach .hydra/*.yaml, install hydra-core=={high}"
    )


@functools.cache
def check_version() -> None:
    """Once per process, before the first patch: a Hydra outside CHECKED is said in one warning."""
    import hydra

    problem = version_problem(hydra.__version__)
    if problem is not None:
        warnings.warn(problem, stacklevel=3)


def basic_sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Each job's overrides as Hydra's basic sweeper expands them (no public API; tests/system/test_cli.py)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


_COMPOSE_HOOKS: list[Any] = []


def on_compose(hook: Any) -> None:
    """Call `hook(cfg)` on every config Hydra composes here, before the command line applies and before it is saved or
    pickled (no public hook that early; tests/integration/test_security.py). Idempotent per hook."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    check_version()
    if hook in _COMPOSE_HOOKS:
        return
    _COMPOSE_HOOKS.append(hook)
    original = ConfigLoaderImpl._compose_config_from_defaults_list
    if getattr(original, "_ds_exp_hooks", None) is not None:
        return

    @functools.wraps(original)
    def compose(self: Any, *args: Any, **kwargs: Any) -> Any:
        cfg = original(self, *args, **kwargs)
        for each in _COMPOSE_HOOKS:
            each(cfg)
        return cfg

    compose._ds_exp_hooks = _COMPOSE_HOOKS  # type: ignore[attr-defined]
    ConfigLoaderImpl._compose_config_from_defaults_list = compose  # type: ignore[method-assign]


_PARSED: dict[tuple[Any, ...], Any] = {}


def cache_config_files() -> None:
    """Parse each config file once per process: Hydra reads every YAML file of the tree again for each composition
    (an autotune grid composes each cell, a notebook each run), and copying a parsed file's config takes 1/6 of the
    time parsing it again does (conf/, measured). Each composition gets its own copy; a file written since (its inode,
    size, mtime or ctime changed) is read again. Hydra's own packaged files (pkg://hydra.*) are installed, not edited;
    the ConfigStore's nodes (structured configs) are never cached. At the repository: Hydra's plugin scan executes
    its config source modules again, which would replace a patched source class."""
    from hydra._internal.config_repository import ConfigRepository
    from hydra.core.object_type import ObjectType

    check_version()
    original = ConfigRepository.load_config
    if getattr(original, "_ds_exp_cached", False):
        return

    def load_config(self: Any, config_path: str) -> Any:
        source = self._find_object_source(config_path=config_path, object_type=ObjectType.CONFIG)
        kind, path = type(source).__name__, str(getattr(source, "path", ""))
        if kind == "FileConfigSource":
            try:
                stat = os.stat(os.path.join(path, source._normalize_file_name(config_path)))
            except OSError:  # Hydra's own message
                return original(self, config_path)
            version: tuple[Any, ...] = (stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)
        elif kind == "ImportlibResourcesConfigSource" and path.startswith("hydra."):
            version = ()
        else:
            return original(self, config_path)
        key = (kind, path, config_path)
        if key not in _PARSED or _PARSED[key][0] != version:  # one entry per file: an edit replaces it
            _PARSED[key] = version, original(self, config_path)
        return copy.deepcopy(_PARSED[key][1])

    load_config._ds_exp_cached = True  # type: ignore[attr-defined]
    ConfigRepository.load_config = load_config  # type: ignore[method-assign]


_OVERRIDE_HOOKS: list[Any] = []


def before_overrides(hook: Any) -> None:
    """Call `hook(overrides, cfg)` (Hydra's parsed Overrides) before every composition applies the command line's
    values; the hook raises to refuse them (tests/bad_inputs.py)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    check_version()
    if hook not in _OVERRIDE_HOOKS:
        _OVERRIDE_HOOKS.append(hook)
    original = ConfigLoaderImpl._apply_overrides_to_config
    if getattr(original, "_ds_exp_hooks", None) is not None:
        return

    def apply(overrides: Any, cfg: Any) -> None:
        for each in _OVERRIDE_HOOKS:
            each(overrides, cfg)
        original(overrides, cfg)

    apply._ds_exp_hooks = _OVERRIDE_HOOKS  # type: ignore[attr-defined]
    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(apply)  # type: ignore[method-assign]


def raise_hydra_errors() -> None:
    """Let Hydra's errors reach ds_exp's error boundary (`ds_exp: error: ...`, exit 2) instead of Hydra printing them
    and exiting 1: `run_and_report` runs the app, --cfg and a sweep (tests/unit/test_bad_inputs.py)."""
    from hydra._internal import utils

    check_version()
    utils.run_and_report = lambda func: func()


def hydra_job_callbacks(config: Any, failed: Callable[[str, Exception], Exception] | None = None) -> Any:
    """The callbacks of a composed config as Hydra's run mode calls them (no public API; tests/unit/test_api.py). With
    `failed`, a callback that raises fails the run with `failed(its name, the error)`; Hydra 1.3 only warns."""
    from hydra._internal.callbacks import Callbacks

    callbacks = Callbacks(config)
    if failed is None:
        return callbacks

    def notify(function_name: str, reverse: bool = False, **kwargs: Any) -> None:
        for callback in reversed(callbacks.callbacks) if reverse else callbacks.callbacks:
            try:
                getattr(callback, function_name)(**kwargs)
            except Exception as err:
                name = f"{type(callback).__module__}.{type(callback).__qualname__}.{function_name}"
                raise failed(name, err) from err

    callbacks._notify = notify  # type: ignore[method-assign]  # this instance only
    return callbacks
