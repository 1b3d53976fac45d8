"""A run directory remembers its run: `hydra.run.dir=R resume=auto [KEY=VALUE ...]` continues R's own config, the
overrides being named changes the resume rules accept or refuse; a resuming sweep job too. Light."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import ValidationError

from ds_exp.config.secrets import ENV_PREFIX
from ds_exp.core.errors import ConfigError, first_line
from ds_exp.core.files import read_json_object, write_text_atomic

_SECRET_REF = re.compile(r"\$\{oc\.env:(" + ENV_PREFIX + r"\w+)")

# In .hydra/: a resumed sweep job's earlier .hydra/*.yaml, kept from before its launch until the job ends
KEPT_DIR = "kept-while-resuming"
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def holds_a_run(run_dir: Path, checkpoint_subdir: str) -> str | None:
    """What shows that `run_dir` holds a run (for messages), or None."""
    if not run_dir.is_dir():
        return None
    if (run_dir / "summary.json").is_file():
        summary = read_summary(run_dir)
        return (
            f"summary.json: status {summary.get('status')} at step {summary.get('steps')}"
            if summary is not None
            else "summary.json"
        )
    for name in ("metrics.jsonl", ".hydra/config.yaml", "ds_config.json"):
        if (run_dir / name).is_file():
            return name
    checkpoints = run_dir / checkpoint_subdir
    if not checkpoints.resolve().is_relative_to(run_dir.resolve()):
        # a train.checkpoint_dir outside may be shared: the checkpointer never touches another run's checkpoints
        return None
    if checkpoints.is_dir() and any(checkpoints.glob("step*")):
        return f"{checkpoint_subdir}/"
    return None


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's summary.json, or None when it is missing or unreadable."""
    return read_json_object(run_dir / "summary.json")


def saved_run_config(run_dir: Path) -> Path | None:
    """The config the run's newest attempt composed (.hydra/resume-<time>/ or .hydra/); None when there is none."""
    later = sorted((run_dir / ".hydra").glob("resume-*/config.yaml"))
    if later:
        return later[-1]
    for first in (run_dir / ".hydra" / KEPT_DIR / "config.yaml", run_dir / ".hydra" / "config.yaml"):
        if first.is_file():
            return first
    return None


def flat_keys(node: object, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(node, dict) and node:
        for key, value in node.items():
            out.update(flat_keys(value, f"{prefix}{key}."))
    else:
        out[prefix.rstrip(".")] = node
    return out


def _changed_key(key: str) -> str:
    """The key a value override replaces whole: an item of a list replaces its list (YAML sets no single item)."""
    parts = key.split(".")
    for depth in range(1, len(parts)):
        if parts[depth].isdigit():
            return ".".join(parts[:depth])
    return key


def added_keys(run_dir: Path) -> list[str]:
    """The keys the run's attempts added with `+`/`++`, as each attempt's overrides.yaml recorded them."""
    keys: list[str] = []
    parser = OverridesParser.create()
    for path in sorted((run_dir / ".hydra").glob("**/overrides.yaml")):
        try:
            lines = OmegaConf.to_container(OmegaConf.load(path))
            items = parser.parse_overrides([str(line) for line in lines]) if isinstance(lines, list) else []
        except Exception:  # a file ds_exp cannot read adds nothing; the config itself is read below
            continue
        keys += [o.key_or_group for o in items if o.is_add() or o.is_force_add()]
    return list(dict.fromkeys(key for key in keys if not key.startswith("hydra")))


def _with_added_keys(now: DictConfig, saved: DictConfig, run_dir: Path) -> DictConfig:
    """`now` plus the keys the run added with `+` (added_keys), so the saved config merges into it typed."""
    target = now.copy()
    for key in added_keys(run_dir):
        if _unresolved(target, key, _ABSENT) is _ABSENT and (value := _unresolved(saved, key, _ABSENT)) is not _ABSENT:
            with open_dict(target):  # as saved: a secret stays the reference to its variable
                OmegaConf.update(target, key, value, merge=False, force_add=True)
    return target


_ABSENT = object()


def continue_run_config(config: DictConfig, run_dir: Path, overrides: list[str]) -> list[str] | None:
    """In place: `config` becomes the saved run's, `overrides` applied again; a line per change (None: no run)."""
    path = saved_run_config(run_dir)
    if path is None:
        found = holds_a_run(run_dir, str(OmegaConf.select(config, "train.checkpoint_dir", default="checkpoints")))
        if found is not None:
            raise ConfigError(
                f"resume: {run_dir} holds a run ({found}) but not its saved config (.hydra/config.yaml), so "
                "ds_exp cannot tell what it was trained with and would continue it with the defaults; nothing was "
                "changed. Put that file back (from a copy of the run), or start a new run in another directory"
            )
        return None
    task_keys = [str(key) for key in config if key != "hydra"]
    now = OmegaConf.masked_copy(config, task_keys)
    try:
        saved = OmegaConf.load(path)
        if not isinstance(saved, DictConfig):
            raise ValueError("not a mapping of settings")
        # typed as now: a key the schema lost is named, not taken silently (one an attempt added with + is taken)
        merged = OmegaConf.merge(_with_added_keys(now, saved, run_dir), saved)
        if not isinstance(merged, DictConfig):
            raise ValueError("not a mapping of settings")
    except Exception as err:  # any failure to read or merge: one message naming the file
        raise ConfigError(
            f"resume: hydra.run.dir={run_dir} holds a config ds_exp cannot continue from ({path}: "
            f"{first_line(err)}); fix or remove that file, or start a new run in another directory"
        ) from None
    choices = config.hydra.runtime.choices if "hydra" in config else {}
    ignored: list[str] = []
    for item in OverridesParser.create().parse_overrides(overrides):
        key = item.key_or_group
        if key.startswith("hydra") or item.is_sweep_override():
            continue
        if key in choices:  # a group choice: that group's node, as its new option composes it
            package = item.package or key.replace("/", ".")
            if key == "experiment" or package in ("_global_", ""):  # presets are `# @package _global_`
                ignored.append(f"{item.input_line} (it sets keys all over the config: give the keys to change)")
                continue
            OmegaConf.update(merged, package, OmegaConf.select(now, package), merge=False)
        elif item.is_delete():
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(merged, parent) if parent else merged
            if isinstance(node, DictConfig) and leaf in node:
                with open_dict(node):
                    del node[leaf]
        else:
            whole = _changed_key(key)
            value = OmegaConf.select(now, whole)  # a subtree keeps its interpolations; a leaf comes resolved:
            value = value if OmegaConf.is_config(value) else _unresolved(now, whole)
            OmegaConf.update(merged, whole, value, merge=False, force_add=True)
    _keep_secrets_reachable(merged, now)
    before = flat_keys(OmegaConf.to_container(saved, resolve=False))
    after = flat_keys(OmegaConf.to_container(merged, resolve=False))
    lines = [
        f"{key}: {before.get(key, '(unset)')} -> {after.get(key, '(unset)')}"
        for key in sorted(before.keys() | after.keys())
        if before.get(key, ...) != after.get(key, ...) and key in after and key != "resume"
    ]
    lines += [f"not applied: {line}" for line in ignored]
    with read_write(config), open_dict(config):
        for key in task_keys:
            config[key] = merged[key]
    return lines


def _unresolved(config: DictConfig, key: str, default: Any = None) -> Any:
    """`key`'s value as composed, interpolations kept: a secret stays a reference in the saved config."""
    node: object = OmegaConf.to_container(config, resolve=False)
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return default
    return node


def _keep_secrets_reachable(merged: DictConfig, now: DictConfig) -> None:
    """A saved reference to a DS_EXP_SECRET_* variable that is gone now takes this composition's value."""
    given_now = flat_keys(OmegaConf.to_container(now, resolve=False))  # unresolved: a secret stays a reference
    missing: list[str] = []
    for key, value in flat_keys(OmegaConf.to_container(merged, resolve=False)).items():
        gone = [name for name in _SECRET_REF.findall(value) if name not in os.environ] if isinstance(value, str) else []
        if gone:
            try:
                OmegaConf.update(merged, key, given_now.get(key), merge=False)
            except ValidationError:
                missing.append(
                    f"resume: {key} held a secret given on an earlier attempt's command line ({gone[0]}), which is "
                    f"saved nowhere; give it again on this command line: {key}=VALUE"
                )
    if missing:
        raise ConfigError(missing)


def resume_note(run_dir: Path, lines: list[str], what: str | None = None) -> str:
    """What a resume continues with, in one message (`what`: the run's name, hydra.run.dir=R unless given)."""
    source = saved_run_config(run_dir)
    where = source.relative_to(run_dir) if source is not None else ".hydra/config.yaml"
    what = what or f"hydra.run.dir={run_dir}"
    if not lines:
        return f"resume: {what} continues with its own config ({where}), unchanged"
    return "\n".join(
        [f"resume: {what} continues with its own config ({where}), changed by this command line:"]
        + [f"  {line}" for line in lines]
    )


def keep_job_config(job_dir: Path, continued: DictConfig) -> Path:
    """Before a resuming sweep job launches: keep its .hydra/*.yaml aside, save `continued` as this attempt's config."""
    hydra_dir = job_dir / ".hydra"
    kept = hydra_dir / KEPT_DIR
    if not kept.is_dir():
        staging = hydra_dir / f".{KEPT_DIR}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in HYDRA_FILES:
            if (hydra_dir / name).is_file():
                shutil.copy2(hydra_dir / name, staging / name)
        staging.rename(kept)  # all of them or none
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    attempt = hydra_dir / f"resume-{stamp}"
    for n in range(1, 1000):  # a launch in the same second as the last: the next name, still sorted after it
        if not attempt.exists():
            break
        attempt = hydra_dir / f"resume-{stamp}_{n}"
    attempt.mkdir()
    task = OmegaConf.masked_copy(continued, [str(key) for key in continued if key != "hydra"])
    write_text_atomic(attempt / "config.yaml", OmegaConf.to_yaml(task))  # unresolved, as Hydra saves it
    return attempt


def take_job_config(composed: DictConfig, job_dir: Path, *, first_rank: bool) -> bool:
    """In a sweep job: the config its sweep kept replaces Hydra's composition (False for a fresh job)."""
    path = saved_run_config(job_dir)
    if not (job_dir / ".hydra" / KEPT_DIR).is_dir() or path is None or not path.parent.name.startswith("resume-"):
        return False
    try:
        merged = OmegaConf.merge(composed, OmegaConf.load(path))
        if not isinstance(merged, DictConfig):
            raise ValueError("not a mapping of settings")
    except Exception as err:  # one message naming the file
        raise ConfigError(
            f"resume: {job_dir} holds a config ds_exp cannot continue from ({path}: {first_line(err)}); fix or "
            "remove that file, or use another hydra.sweep.dir"
        ) from None
    with read_write(composed), open_dict(composed):
        for key in [str(key) for key in composed]:
            composed[key] = merged[key]
    if first_rank:
        for name in HYDRA_FILES[1:]:
            if (job_dir / ".hydra" / name).is_file() and not (path.parent / name).exists():
                shutil.copy2(job_dir / ".hydra" / name, path.parent / name)
    return True


def finish_job_attempt(job_dir: Path) -> None:
    """At a resumed sweep job's end (first rank): the .hydra/*.yaml kept before launch go back in place of Hydra's."""
    kept = job_dir / ".hydra" / KEPT_DIR
    if not kept.is_dir():
        return
    for name in HYDRA_FILES:
        if (kept / name).is_file():
            os.replace(kept / name, job_dir / ".hydra" / name)
    shutil.rmtree(kept, ignore_errors=True)


def task_overrides(config: DictConfig) -> list[str]:
    """hydra.overrides.task unresolved: a secret stays a reference, and `${` in a value is not an interpolation."""
    task = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    return [str(item) for item in task] if isinstance(task, list) else []


def named_run_dir(config: DictConfig) -> Path | None:
    """The run directory the command line named (for a rank > 0, the first one named), None when Hydra chose it."""
    for override in config.hydra.overrides.hydra:
        key, _, value = str(override).lstrip("+").partition("=")
        if key == "hydra.run.dir":
            return Path(value)
    return None
