"""Values of a shape the other checks cannot look at, found first: a list item of another type than the schema says
(OmegaConf lets `optimizer.betas=[{a:1}]` in), and a path name too long for any file system. Light."""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

from ds_exp.config.output_paths import NAME_MAX

PATH_MAX = 4096  # bytes per path on Linux
# the schema's keys that hold a path (any other string is taken as one when it holds a separator)
PATH_KEYS = frozenset(
    {"path", "eval_path", "name_or_path", "tokenizer", "cache_dir", "checkpoint_dir", "export_dir", "nvme_path"}
    | {"prompts_file", "config_file", "dir", "resume"}
)


def shape_problems(node: object, prefix: str = "") -> list[str]:
    """One line per list item of the wrong type and per impossible path, in the config or its section after `prefix`."""
    problems: list[str] = []
    _walk(node, prefix, problems)
    return problems


def _walk(node: Any, key: str, problems: list[str]) -> None:
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value, where = getattr(node, f.name), f"{key}{f.name}"
        if where in ("model.arch", "deepspeed.config"):
            continue  # transformers' and DeepSpeed's own to read
        if dataclasses.is_dataclass(value):
            _walk(value, f"{where}.", problems)
        elif isinstance(value, list):
            item_type = _item_type(hints[f.name])
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _walk(item, f"{where}[{i}].", problems)
                elif item_type is not None and not _is(item, item_type):
                    problems.append(
                        f"{where}={_shown(value)}: item {i} is {type(item).__name__}, not {_named(item_type)}; give "
                        f"a list of {_named(item_type)}s"
                    )
                    break
        elif isinstance(value, str) and (problem := path_too_long(value, f.name in PATH_KEYS)):
            problems.append(f"{where}: {problem}")


def _item_type(hint: Any) -> type | None:
    """X of a list[X] field (through `| None`) when X is a plain type; None for anything else."""
    for candidate in (hint, *typing.get_args(hint)):
        if typing.get_origin(candidate) is list:
            (item,) = typing.get_args(candidate)
            return item if item in (str, int, float, bool) else None
    return None


def _is(item: object, kind: type) -> bool:
    if kind is float:
        return isinstance(item, (int, float)) and not isinstance(item, bool)
    if kind is int:
        return isinstance(item, int) and not isinstance(item, bool)
    return isinstance(item, kind)


def _named(kind: type) -> str:
    return {str: "string", int: "whole number", float: "number", bool: "boolean"}[kind]


def _shown(value: list[Any]) -> str:
    text = str(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def path_too_long(value: str, path_key: bool = True) -> str | None:
    """Why `value`, taken as a path, cannot exist; None when it can, or when it is no path."""
    if not path_key and os.sep not in value:
        return None
    longest = max(value.split(os.sep), key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > NAME_MAX:
        return (
            f"the name {longest[:40]}... has {len(os.fsencode(longest))} bytes, more than file systems allow "
            f"({NAME_MAX}); give a shorter name"
        )
    if len(os.fsencode(value)) > PATH_MAX:
        return f"the path has {len(os.fsencode(value))} bytes, more than file systems allow ({PATH_MAX}); shorten it"
    return None
