"""`data_config_problems`: cheap checks of the data settings before anything heavy, so a sweep fails at submission
and not minutes later on a compute node."""

from __future__ import annotations

import os

from omegaconf import MISSING

from ds_exp.config.paths import data_cache_dir, not_a_directory
from ds_exp.config.ranges import range_problems
from ds_exp.config.schema import DataConfig, DataSource, path_not_set, plain
from ds_exp.core.private_files import UnsafePath, check_own
from ds_exp.core.user_paths import special_file_problem
from ds_exp.data.conversations import LAYOUTS
from ds_exp.data.formats import FILE_FORMATS, expand, resolve_format
from ds_exp.data.splits import parse_data_split

TEMPLATES = ("raw", "dschat", "chat_template", "auto")


def source_problems(src: DataSource, key: str) -> list[str]:
    problems: list[str] = []
    path = src.path
    if not path or path == MISSING:
        return [path_not_set(key)]
    fmt = src.format or "auto"
    for field, value in (("path", path), ("eval_path", src.eval_path)):
        if value and (special := special_file_problem(f"{key}.{field}", expand(value))) is not None:
            return [special]  # before anything opens it (a FIFO would block, /dev/zero never ends)
    try:
        resolved = resolve_format(path, fmt)
    except ValueError as err:
        what = "format" if "unknown format" in str(err) else "path"
        shown = fmt if what == "format" else path
        problems.append(f"{key}.{what}={shown}: {err}")
        resolved = None
    layout = src.layout or "auto"
    if layout not in LAYOUTS:
        problems.append(f"{key}.layout={layout}: unknown row layout; use one of {', '.join(LAYOUTS)}")
    for field, value in (("prompt_field", src.prompt_field), ("chosen_field", src.chosen_field)):
        if not value:
            problems.append(f"{key}.{field} is empty; name the column that holds it (default {field[:-6]})")
    if src.eval_path:
        if resolved is not None and resolved not in FILE_FORMATS:
            problems.append(f"{key}.eval_path is only for file sources (json, jsonl, csv, parquet); remove it")
        else:
            try:
                resolve_format(src.eval_path, resolved or fmt)
            except ValueError as err:
                problems.append(f"{key}.eval_path={src.eval_path}: {err}")
    return problems


def data_config_problems(data: DataConfig) -> list[str]:
    """Problems of the data settings, one line each; empty when they look usable."""
    problems = [line for _, line in range_problems(data, "data.")]
    try:
        parse_data_split(data.data_split)
    except ValueError as err:
        problems.append(f"data.data_split={data.data_split}: {err}")
    template = plain(data.template)
    if template not in TEMPLATES:
        problems.append(f"data.template={template}: use one of {', '.join(TEMPLATES)}")
    if data.end_of_conversation_token is not None and not data.end_of_conversation_token:
        problems.append("data.end_of_conversation_token is empty; set null to use the tokenizer's eos")
    cache_dir = data.cache_dir
    if cache_dir is not None and not cache_dir:
        problems.append("data.cache_dir is empty; set a directory for the tokenized cache, or null for your own")
    elif (in_the_way := not_a_directory(data_cache_dir(cache_dir))) is not None:
        where = "" if in_the_way == data_cache_dir(cache_dir) else f": {in_the_way}"
        problems.append(
            f"data.cache_dir={data_cache_dir(cache_dir)}{where} is a file, not a directory; point data.cache_dir at "
            "a directory"
        )
    elif os.path.lexists(cache := data_cache_dir(cache_dir)):
        try:  # a shared machine: never a link, nor another user's directory (ds_exp/core/private_files.py)
            check_own(cache, directory=True)
        except UnsafePath as err:
            problems.append(f"data.cache_dir={err}")  # the message starts with the path
    for name in ("sources", "sft_only_sources"):
        for i, src in enumerate(getattr(data, name)):
            problems += source_problems(src, f"data.{name}[{i}]")
    return problems


def no_eval_note(data: DataConfig) -> str:
    """Said once when the eval set is empty: evaluation is off for the whole run, and why."""
    why = (
        "data.synthetic.num_eval=0"
        if not data.sources and not data.sft_only_sources
        else f"no source has an eval split and data.eval_fraction={data.eval_fraction}"
    )
    return f"no eval set ({why}): evaluation is off, so metrics.jsonl and summary.json have no eval_loss or perplexity"
