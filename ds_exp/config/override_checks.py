"""Command-line overrides Hydra would misread (a list item past the end, a retired key, another optimizer's setting,
a one-value comma list it would read as a sweep), each said in one line with its fix."""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import fields
from typing import TYPE_CHECKING

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from ds_exp.config.optimizers import OPTIMIZERS
from ds_exp.core.compat import before_overrides

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

# the data options whose sources are files, and what each reads
FILE_DATA_OPTIONS = {
    "dschat_local": "DeepSpeed-Chat's directory of train.json [+ eval.json]",
    "local": "JSON, JSONL, CSV, Parquet or a save_to_disk directory",
    "blend": "several datasets blended",
}


def list_item_problem(key: str, input_line: str, cfg: DictConfig) -> str | None:
    """The message for an override whose dotted key indexes past the end of a list of `cfg`; None otherwise."""
    parts = key.split(".")
    for depth in range(1, len(parts)):
        if not parts[depth].isdigit():
            continue
        parent = ".".join(parts[:depth])
        node = OmegaConf.select(cfg, parent, throw_on_missing=False)
        if not isinstance(node, ListConfig) or int(parts[depth]) < len(node):
            continue
        size = f"{len(node)} item{'s' if len(node) != 1 else ''}" if len(node) else "no items"
        if parent == "data.sources" and not len(node):
            option = OmegaConf.select(cfg, "data.name", default="?")
            choices = [f"data={name} ({what})" for name, what in FILE_DATA_OPTIONS.items() if name != option]
            return (
                f"{input_line}: data={option} has no data.sources[{parts[depth]}] (it reads no files: its sources "
                f"list is empty); add a data option that reads files: {', '.join(choices[:-1])} or {choices[-1]}; "
                f"e.g. python -m ds_exp ... data=dschat_local {input_line}"
            )
        return (
            f"{input_line}: {parent} has {size}, so there is no {parent}[{parts[depth]}]; set the items it has, or "
            f"give the whole list: '{parent}=[...]'"
        )
    return None


# keys ds_exp had and no longer has: what replaced them (Hydra would only say the key is not in the schema)
RETIRED = {
    "train.export_adapter": (
        "with LoRA every export writes the adapter (<export_dir>_adapter) now; train.export_merged=end|every|none "
        "says which exports also hold the merged model (default end: the final one)"
    ),
}


def optimizer_key_problem(key: str, input_line: str, cfg: DictConfig) -> str | None:
    """The message for an override of a setting the chosen optimizer lacks but others have; None otherwise."""
    group, _, setting = key.lstrip("+").partition(".")
    node = cfg.get("optimizer") if group == "optimizer" and setting and "." not in setting else None
    if not isinstance(node, DictConfig) or setting in node:
        return None
    having = [name for name, entry in OPTIMIZERS.items() if setting in {f.name for f in fields(entry.settings)}]
    if not having:
        return None  # no optimizer has it: Hydra's own message names the unknown key
    own = ", ".join(map(str, node))
    return (
        f"{input_line}: optimizer={node.get('name')} has no setting {setting} (its settings: {own}); the optimizers "
        f"that have it: {', '.join(having)} (choose one with optimizer=<name>)"
    )


def _check(overrides: list[Override], cfg: DictConfig) -> None:
    for override in overrides:
        if override.is_delete() or override.input_line is None:
            continue
        key = override.key_or_group.lstrip("+")
        if key in RETIRED:
            raise ConfigCompositionException(f"{override.input_line}: {key} is no more: {RETIRED[key]}")
        problem = list_item_problem(override.key_or_group, override.input_line, cfg) or optimizer_key_problem(
            override.key_or_group, override.input_line, cfg
        )
        if problem is not None:
            raise ConfigCompositionException(problem)


def check_list_items_when_composing() -> None:
    before_overrides(_check)


# keys whose one value is a comma-separated list: a sweep over their parts would mean nothing
ONE_VALUE_LISTS = ("data.data_split",)
# key=a,b,... with no quotes, brackets or parentheses: Hydra's simple sweep (choice(...), [..], '..' are left alone)
_SIMPLE_SWEEP = re.compile(r"^(\+{0,2})([\w.]+)=([^'\"\[\](){}=]*,[^'\"\[\](){}=]*)$")


def quote_one_value_lists(args: list[str]) -> list[str]:
    """`data.data_split=10,0,0` -> `data.data_split='10,0,0'` (one value, as meant); every other argument as is."""
    quoted = []
    for arg in args:
        match = _SIMPLE_SWEEP.match(arg)
        if match and match.group(2) in ONE_VALUE_LISTS:
            arg = f"{match.group(1)}{match.group(2)}='{match.group(3)}'"
        quoted.append(arg)
    return quoted


# OmegaConf's diagnostics under its message: where the key is, not what is wrong with it
_DIAGNOSTICS = re.compile(r"^\s*(full_key:|reference_type=|object_type=)")


def composition_problem(err: Exception) -> str:
    """Hydra's refusal of the command line as one line: the override, what is wrong and the choices there are."""
    cause = err.__cause__
    missing = err.missing_cfg_file if isinstance(err, MissingConfigException) else None
    if isinstance(err, MissingConfigException) and err.options and missing and "/" in missing:
        group, _, name = missing.rpartition("/")
        return f"{group}={name}: {group} has no option {name}; its options: {', '.join(err.options)}"
    if isinstance(err, OverrideParseException):
        detail = [line for line in _lines(err) if not line.startswith(("Error parsing override", "See https://"))]
        return f"{err.override}: not an override Hydra can parse ({'; '.join(detail)}); key=value, group=option"
    if isinstance(cause, OmegaConfBaseException) and cause.full_key and str(err).startswith("Could not override"):
        given = re.search(r"Could not override '([^']+)'", str(err))
        parent, _, key = str(cause.full_key).rpartition(".")
        owner = cause.object_type
        names = [f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else []
        close = difflib.get_close_matches(str(key), names, n=1)
        hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
        where = f"`python -m ds_exp --help {parent.split('.')[0]}`" if parent else "`python -m ds_exp --help`"
        return (
            f"{given.group(1) if given else cause.full_key}: ds_exp's config has no key {cause.full_key}; {hint}"
            f"{where} lists the keys"
        )
    if isinstance(cause, ValidationError) and str(err).startswith("Error merging override "):
        return f"{str(err).removeprefix('Error merging override ')}: {_lines(cause)[0]}"
    lines = _lines(err) + (_lines(cause) if isinstance(cause, OmegaConfBaseException) else [])
    return "; ".join(line.rstrip(".") for line in lines) or type(err).__name__


def _lines(err: BaseException) -> list[str]:
    return [line.strip() for line in str(err).splitlines() if line.strip() and not _DIAGNOSTICS.match(line)]
