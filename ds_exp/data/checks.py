"""`check_data_config`: cheap checks of `cfg.data` run before anything heavy is imported (dry run, launch).

Each problem is one line naming the key, what is wrong and the fix, so a sweep fails at submission and not
minutes later on a compute node.
"""

from __future__ import annotations

from typing import Any

from ds_exp.data.conversations import LAYOUTS
from ds_exp.data.formats import FILE_FORMATS, expand, resolve_format
from ds_exp.data.splits import parse_data_split
from ds_exp.paths import not_a_directory

TEMPLATES = ("raw", "dschat", "chat_template", "auto")


def _get(node: Any, key: str, default: Any = None) -> Any:
    """Works on DictConfig, dataclasses and dicts alike; enums become their value, `???` becomes None."""
    try:
        value = node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)
    except Exception as err:  # omegaconf's MissingMandatoryValue, without importing omegaconf here
        if type(err).__name__ == "MissingMandatoryValue":
            return None
        raise
    if value == "???":
        return None
    return getattr(value, "value", value)


def check_source(src: Any, key: str) -> list[str]:
    problems: list[str] = []
    path = _get(src, "path")
    if not path or not isinstance(path, str):
        hint = key.replace("[", ".").replace("]", "")  # Hydra override syntax: data.sources.0.path
        return [
            f"{key}.path is not set; set it to a data file, a directory or a hub id (e.g. {hint}.path=/data/x.jsonl)"
        ]
    fmt = str(_get(src, "format", "auto") or "auto")
    try:
        resolved = resolve_format(path, fmt)
    except ValueError as err:
        what = "format" if "unknown format" in str(err) else "path"
        shown = fmt if what == "format" else path
        problems.append(f"{key}.{what}={shown}: {err}")
        resolved = None
    layout = str(_get(src, "layout", "auto") or "auto")
    if layout not in LAYOUTS:
        problems.append(f"{key}.layout={layout}: unknown row layout; use one of {', '.join(LAYOUTS)}")
    for field in ("prompt_field", "chosen_field"):
        if not _get(src, field):
            problems.append(f"{key}.{field} is empty; name the column that holds it (default {field[:-6]})")
    eval_path = _get(src, "eval_path")
    if eval_path:
        if resolved is not None and resolved not in FILE_FORMATS:
            problems.append(f"{key}.eval_path is only for file sources (json, jsonl, csv, parquet); remove it")
        else:
            try:
                resolve_format(eval_path, resolved or fmt)
            except ValueError as err:
                problems.append(f"{key}.eval_path={eval_path}: {err}")
    return problems


def check_data_config(cfg: Any) -> list[str]:
    """Problems of cfg.data, one line each; empty when the data settings look usable."""
    data = _get(cfg, "data")
    if data is None:
        return ["data: missing; pick an option, e.g. data=synthetic"]
    problems: list[str] = []
    max_seq_len = _get(data, "max_seq_len")
    if not isinstance(max_seq_len, int) or max_seq_len <= 0:
        problems.append(f"data.max_seq_len={max_seq_len}: must be a positive integer, e.g. 512")
    try:
        parse_data_split(_get(data, "data_split", "10,0,0"))
    except ValueError as err:
        problems.append(f"data.data_split={_get(data, 'data_split')}: {err}; e.g. 2,4,4 or 10,0,0")
    frac = _get(data, "eval_fraction", 0.0)
    if not isinstance(frac, (int, float)) or not 0 <= frac < 1:
        problems.append(f"data.eval_fraction={frac}: must be in [0, 1), e.g. 0.05")
    template = _get(data, "template", "dschat")
    if template not in TEMPLATES:
        problems.append(f"data.template={template}: use one of {', '.join(TEMPLATES)}")
    eot = _get(data, "end_of_conversation_token")
    if eot is not None and not str(eot):
        problems.append("data.end_of_conversation_token is empty; set null to use the tokenizer's eos")
    num_proc = _get(data, "num_proc")
    if num_proc is not None and (not isinstance(num_proc, int) or num_proc < 1):
        problems.append(f"data.num_proc={num_proc}: must be >= 1, or null to decide from the data size")
    max_eval = _get(data, "max_eval_examples")
    if max_eval is not None and (not isinstance(max_eval, int) or max_eval < 1):
        problems.append(f"data.max_eval_examples={max_eval}: must be >= 1, or null for all")
    cache_dir = _get(data, "cache_dir")
    if not cache_dir:
        problems.append("data.cache_dir is empty; set a directory for the tokenized cache")
    elif (in_the_way := not_a_directory(expand(str(cache_dir)))) is not None:
        where = "" if in_the_way == expand(str(cache_dir)) else f": {in_the_way}"
        problems.append(
            f"data.cache_dir={cache_dir}{where} is a file, not a directory; point data.cache_dir at a directory"
        )
    sources = list(_get(data, "sources") or [])
    sft_only = list(_get(data, "sft_only_sources") or [])
    for i, src in enumerate(sources):
        problems += check_source(src, f"data.sources[{i}]")
    for i, src in enumerate(sft_only):
        problems += check_source(src, f"data.sft_only_sources[{i}]")
    if not sources and not sft_only:
        synthetic = _get(data, "synthetic")
        num_train = _get(synthetic, "num_train", 0) if synthetic is not None else 0
        num_eval = _get(synthetic, "num_eval", 0) if synthetic is not None else 0
        if not isinstance(num_train, int) or num_train < 1:
            problems.append(f"data.synthetic.num_train={num_train}: must be >= 1 (or set data.sources)")
        if not isinstance(num_eval, int) or num_eval < 0:
            problems.append(f"data.synthetic.num_eval={num_eval}: must be >= 0")
    return problems
