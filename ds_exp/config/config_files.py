"""A user's own config files (`--config-dir`, `hydra.searchpath`) checked before Hydra reads them, each problem one
message naming the file and the fix (a defaults loop: not a RecursionError 2,000 lines long). Light: yaml only."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from ds_exp.config.paths import conf_dir
from ds_exp.core.errors import ConfigError

_PACKAGE = re.compile(r"^\s*#\s*@package\s+(\S+)")
CONFIG_DIR_FLAGS = ("-cd", "--config-dir")


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a mapping giving one key twice (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"`{key}` is given twice in one mapping (lines {seen[key]} and {line}); keep one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: Path) -> Any:
    """The file's YAML, or one ConfigError naming the file, the line and the fix."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file; save it as UTF-8 YAML; nothing was run") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror}); nothing was run") from None
    except yaml.MarkedYAMLError as err:
        what = err.problem or err.context or "not YAML"
        if "given twice" in what:
            raise ConfigError(f"{path}: {what}; nothing was run") from None
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            f"{path}: not valid YAML{where} ({what}); fix that line (quote a value holding `: `, `#` or `{{`); "
            "nothing was run"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err}); nothing was run") from None


def user_config_dirs(args: Iterable[str]) -> list[Path]:
    """The directories a command line adds to Hydra's search path: --config-dir/-cd, hydra.searchpath=[file://..]."""
    dirs: list[Path] = []
    args = list(args)
    for i, arg in enumerate(args):
        if arg in CONFIG_DIR_FLAGS and i + 1 < len(args):
            dirs.append(Path(args[i + 1]).expanduser())
        elif arg.startswith(tuple(f"{flag}=" for flag in CONFIG_DIR_FLAGS)):
            dirs.append(Path(arg.split("=", 1)[1]).expanduser())
        elif arg.lstrip("+").startswith("hydra.searchpath="):
            dirs += [Path(p) for p in re.findall(r"file://([^,\]\s'\"]+)", arg)]
    return [d.absolute() for d in dirs]


def chosen_configs(args: Iterable[str]) -> list[str]:
    """The config paths the command line's group choices name (`experiment=mine` -> experiment/mine.yaml)."""
    chosen: list[str] = []
    for arg in args:
        if arg.startswith("-") or "=" not in arg or "." in arg.split("=", 1)[0]:
            continue
        try:
            (override,) = OverridesParser.create().parse_overrides([arg])
        except HydraException:
            continue  # Hydra says what is wrong with it
        value = override.value()
        options = getattr(value, "list", None) if override.is_sweep_override() else [value]
        group = override.key_or_group.lstrip("/")
        chosen += [f"{group}/{option}.yaml" for option in options or [] if isinstance(option, str)]
    return chosen


def check_config_files(args: list[str]) -> None:
    """The user's config files a command line would compose (see the module docstring): one ConfigError."""
    dirs = user_config_dirs(args)
    if dirs:
        checked: set[str] = set()
        for config_path in chosen_configs(args):
            _check(config_path, dirs, [], checked)


def _found(config_path: str, dirs: list[Path]) -> Path | None:
    """The user's file Hydra reads for `config_path`; None when ds_exp's own conf/ has it, or no directory does."""
    if (conf_dir() / config_path).is_file():
        return None
    return next((d / config_path for d in dirs if (d / config_path).is_file()), None)


def _check(config_path: str, dirs: list[Path], stack: list[str], checked: set[str]) -> None:
    path = _found(config_path, dirs)
    if path is None or config_path in checked:
        return
    if config_path in stack:
        raise ConfigError(_loop([*stack[stack.index(config_path) :], config_path], dirs))
    body = read_config_file(path)
    if body is not None and not isinstance(body, dict):
        raise ConfigError(
            f"{path}: holds a {type(body).__name__}, not a mapping of settings (key: value lines); nothing was run"
        )
    if config_path.startswith("experiment/") and _package(path) != "_global_":
        raise ConfigError(
            f"{path}: an experiment file sets keys of the whole config, so its first line must be "
            "`# @package _global_` (without it Hydra puts every key under `experiment.`); add that line at the top "
            "of the file; nothing was run"
        )
    for included in _included(config_path, body):
        _check(included, dirs, [*stack, config_path], checked)
    checked.add(config_path)


def _loop(loop: list[str], dirs: list[Path]) -> str:
    chain = " -> ".join(p.removesuffix(".yaml") for p in loop)
    first, second = _found(loop[0], dirs), _found(loop[1], dirs)
    if len(loop) == 2:
        return (
            f"{first} includes itself in its defaults list ({chain}), without end; remove that entry; nothing was run"
        )
    return (
        f"{first} and {second} include each other through their defaults lists ({chain}), without end; remove one "
        "of those entries; nothing was run"
    )


def _package(path: Path) -> str | None:
    """The `# @package X` of the file's header (its leading comment lines), None without one."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return None
        if match := _PACKAGE.match(line):
            return match.group(1)
    return None


def _included(config_path: str, body: Any) -> list[str]:
    """The config paths a file's defaults list includes (`/experiment/x`, `x` of its own group, `group: option`)."""
    base = posixpath.dirname(config_path)
    entries = body.get("defaults", []) if isinstance(body, dict) else []
    out: list[str] = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, str) and entry != "_self_":
            name = re.sub(r"^optional\s+", "", entry).split("@")[0].strip()
            out.append(name[1:] if name.startswith("/") else posixpath.join(base, name))
        elif isinstance(entry, dict):
            for key, option in entry.items():
                group = re.sub(r"^(override|optional)\s+", "", str(key)).split("@")[0].strip()
                group = group[1:] if group.startswith("/") else posixpath.join(base, group)
                options = option if isinstance(option, list) else [option]
                out += [posixpath.join(group, o) for o in options if isinstance(o, str) and o != "???"]
    return [p if p.endswith(".yaml") else f"{p}.yaml" for p in out]
