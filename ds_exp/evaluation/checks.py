"""What the evaluation refuses before any model loads, one line each. Light (lm-eval's loader imports datasets, never
torch). A `TaskSpec` is a built-in, a registry name or a YAML file, its metrics named as harness.json names them."""

from __future__ import annotations

import contextlib
import difflib
import functools
import glob
import importlib.metadata
import importlib.util
import io
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ds_exp.config.features import CheckFacts
from ds_exp.config.model_checks import looks_like_local_path
from ds_exp.config.paths import user_cache_dir
from ds_exp.config.schema import ModelConfig
from ds_exp.config.secrets import register_secrets
from ds_exp.core.errors import first_line
from ds_exp.core.files import write_json_atomic
from ds_exp.core.private_files import UnsafePath, cache_entry, private_dir
from ds_exp.data.cache import hash_key, path_fingerprint
from ds_exp.evaluation.fit import Asked, ModelFit, loaded_problems, passkey_problems, run_model_fit
from ds_exp.evaluation.settings import HarnessConfig
from ds_exp.evaluation.tasks import PASSKEY, SYNTHETIC
from ds_exp.launch.hub import cached, hf_cache, hub_address, offline, unreachable

INSTALL = 'pip install -e ".[eval]" (or pip install lm-eval)'
LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow", "pandas")  # datasets' loaders of local files
DEFAULT_METRICS = {  # lm-eval's metrics for a task that names none (lm_eval.api.registry's defaults)
    "multiple_choice": ("acc", "acc_norm"),
    "loglikelihood": ("perplexity", "acc"),
    "loglikelihood_rolling": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
    "generate_until": ("exact_match",),
}


@dataclass(frozen=True)
class Scoring:
    """What the feature is handed (feature.py builds it): eval.harness, and what it reads of the run around it."""

    harness: HarnessConfig
    lengths: tuple[int, ...]  # ds_exp_passkey's (HarnessConfig.lengths)
    export: bool = True  # train.export: the final export, which the run's scores are of
    export_every: int = 0  # train.export_every: the step exports eval.harness.every_save scores
    model: ModelConfig | None = None  # the model the tasks are checked against (its positions, its tokenizer)


@dataclass(frozen=True)
class TaskSpec:
    """One TASK as given, resolved: what lm-eval is asked (`name`, or the YAML `path`) and the numbers it reports."""

    given: str
    name: str  # lm-eval's task or group name
    kind: str  # builtin | registry | file
    path: str | None = None  # the task's YAML file (a file, or the registry's entry)
    metrics: dict[str, tuple[str, ...]] = field(default_factory=dict)  # result name -> metric names
    fingerprint: str = ""  # what the base model's score cache keys it by

    @property
    def request(self) -> str:
        """What lm-eval's TaskManager.load is given."""
        return self.path if self.kind == "file" and self.path else self.name


def problems(scoring: Scoring, facts: CheckFacts) -> list[str]:
    """eval.harness with the exports, and its tasks against the run's model (FEATURE.problems)."""
    harness = scoring.harness
    found: list[str] = []
    if harness.every_save and scoring.export_every <= 0:
        found.append(
            "eval.harness.every_save=true scores the exports of train.export_every, which is 0: set "
            "train.export_every=N (exports every N steps), or eval.harness.every_save=false"
        )
    if harness.every_save and not harness.tasks:
        found.append("eval.harness.every_save=true without eval.harness.tasks: name the tasks to score")
    if not harness.tasks:
        return found
    if not scoring.export:
        found.append(
            "eval.harness.tasks scores the run's final export, which train.export=false leaves out: set "
            "train.export=true, or score a checkpoint later with python -m ds_exp.evaluate"
        )
    found += device_problems(harness.device, "eval.harness.device", facts.accelerator)
    specs, more = resolve_tasks(list(harness.tasks), scoring.lengths, key="eval.harness.tasks")
    if more or scoring.model is None:
        return found + more
    model = run_model_fit(scoring.model)
    return found + task_problems(specs, model, Asked(harness.limit, harness.num_fewshot), scoring.lengths)[0]


def device_problems(device: str, key: str, accelerator: str) -> list[str]:
    """The device lm-eval runs on (eval.harness.device, or the command's --device), on this machine."""
    device = str(device)
    if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        return [f"{key}={device}: use auto, cpu, cuda or cuda:N"]
    if device.startswith("cuda") and accelerator != "cuda":
        return [f"{key}={device}: this machine has no CUDA device (the accelerator is {accelerator}); use cpu or auto"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = len(visible.split(",")) if visible else len(glob.glob("/dev/nvidia[0-9]*"))
    if device.startswith("cuda:") and count and int(device[5:]) >= count:
        return [f"{key}={device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}; give one"]
    return []


def task_problems(
    specs: list[TaskSpec], model: ModelFit | None, asked: Asked, lengths: tuple[int, ...]
) -> tuple[list[str], int]:
    """(problems, bytes lm-eval will write) of the local tasks against the model; registry tasks, when scored."""
    found: list[str] = []
    size = 0
    for spec in specs:
        if spec.kind == "builtin" and spec.name == PASSKEY and model is not None:
            found += passkey_problems(lengths, model, asked)
        if spec.kind != "file" or spec.path is None:
            continue
        path = Path(spec.path)  # loaded as it was resolved (a group's with lm-eval's registry)
        loaded = _loads(spec.path, hash_key(path_fingerprint(path)), "group" in _read_yaml(path))
        if isinstance(loaded, dict):
            more, written = loaded_problems(spec.given, loaded, model, asked, key=asked.key("tasks"), run_code=False)
            found, size = found + more, size + written
    return found, size


def resolve_tasks(given: list[str], lengths: tuple[int, ...], *, key: str) -> tuple[list[TaskSpec], list[str]]:
    """(what each TASK is, the problems: one line each, naming `key`)."""
    if not given:
        return [], []
    if importlib.util.find_spec("lm_eval") is None:
        return [], [f"{key}: lm-evaluation-harness is not installed; {INSTALL}"]
    specs: list[TaskSpec] = []
    problems: list[str] = []
    for task in given:
        try:
            spec = _resolve(str(task), lengths)
        except TaskProblem as err:
            problems.append(f"{key}: {task}: {err}")
            continue
        if any(s.name == spec.name for s in specs):
            problems.append(f"{key}: {task}: the task {spec.name} is named twice; name it once")
        specs.append(spec)
    return specs, problems


class TaskProblem(Exception):
    """Why one TASK cannot be scored here (the message, without the task's name)."""


def _resolve(task: str, lengths: tuple[int, ...]) -> TaskSpec:
    if task == SYNTHETIC:
        return TaskSpec(task, task, "builtin", metrics={SYNTHETIC: ("acc",)}, fingerprint=task)
    if task == PASSKEY:
        metrics: dict[str, tuple[str, ...]] = {PASSKEY: ("exact_match",)}
        metrics |= {f"{PASSKEY}_{n}": ("exact_match",) for n in lengths}
        return TaskSpec(task, task, "builtin", metrics=metrics, fingerprint=f"{task}{list(lengths)}")
    if task.endswith((".yaml", ".yml")) or looks_like_local_path(task):
        return _file_task(task)
    return _registry_task(task)


def _file_task(task: str) -> TaskSpec:
    path = Path(task).expanduser()
    if not path.is_file():
        raise TaskProblem(f"no such task YAML file ({path.absolute()}); give an lm-eval task name or a YAML file")
    cfg = _read_yaml(path)
    register_secrets(cfg)  # a token in its dataset_kwargs: blanked wherever lm-eval copies it (files, logs)
    name = cfg.get("task") if isinstance(cfg.get("task"), str) else cfg.get("group")
    if not isinstance(name, str):
        raise TaskProblem("not an lm-eval task YAML: it names no `task` (or `group`); see lm-eval's task guide")
    if "group" in cfg and not cfg.get("task"):  # lm-eval divides by its tasks' sizes: ZeroDivisionError
        raise TaskProblem(f"its group {name} holds no tasks; name its tasks under `task:`")
    data = _data_problem(cfg)
    if data:
        raise TaskProblem(data)
    loaded = _loads(str(path.resolve()), hash_key(path_fingerprint(path)), "group" in cfg)
    if isinstance(loaded, str):
        raise TaskProblem(loaded)
    material = {"yaml": path_fingerprint(path), "data": [path_fingerprint(p) for p in _data_files(cfg)]}
    metrics = {name: _metric_names(cfg)} if "group" not in cfg else {str(cfg["group"]): _aggregate_names(cfg)}
    return TaskSpec(task, name, "file", str(path.resolve()), metrics, hash_key(material))


def _registry_task(task: str) -> TaskSpec:
    index = registry_index()
    entry = index.get(task)
    if entry is None:
        close = difflib.get_close_matches(task, list(index), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise TaskProblem(
            f"lm-eval knows no such task or group; {hint}`lm-eval ls tasks` lists its own, or give a task YAML file"
        )
    metrics: dict[str, tuple[str, ...]] = {}
    for name, cfg in _leaves(task, index, set()):
        problem = _data_problem(cfg)
        if problem:
            raise TaskProblem(f"{f'its task {name}: ' if name != task else ''}{problem}")
        metrics[name] = _metric_names(cfg) if "group" not in cfg else _aggregate_names(cfg)
    return TaskSpec(task, task, "registry", entry[1], metrics, hash_key([task, entry[1]]))


def _leaves(name: str, index: dict[str, list[Any]], seen: set[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, config) of a registry entry and everything it runs (a group's tasks, a tag's)."""
    if name in seen:
        return
    seen.add(name)
    kind, path, members = index[name]
    if kind == "TAG":
        for member in members:
            yield from _leaves(member, index, seen)
        return
    cfg = _read_yaml(Path(path)) if path else {}
    yield name, cfg
    if kind == "GROUP":
        for member in cfg.get("task") or []:
            member_name = member if isinstance(member, str) else (member or {}).get("task")
            if isinstance(member_name, str) and member_name in index:
                yield from _leaves(member_name, index, seen)


def _data_files(cfg: dict[str, Any]) -> list[Path]:
    files = ((cfg.get("dataset_kwargs") or {}).get("data_files")) or []
    values = files.values() if isinstance(files, dict) else [files]
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    return [Path(str(f)).expanduser() for f in flat if "://" not in str(f)]


def _data_problem(cfg: dict[str, Any]) -> str | None:
    """Why the task's data cannot be read here: a data file missing, or a hub dataset out of reach."""
    source = cfg.get("dataset_path")
    if not isinstance(source, str) or not source or "group" in cfg:
        return None
    if source in LOCAL_LOADERS:
        missing = [str(p.absolute()) for p in _data_files(cfg) if not p.exists() and not glob.glob(str(p))]
        if missing:
            return f"its data file {missing[0]} is missing (dataset_kwargs.data_files); fix the path or create it"
        return None
    if looks_like_local_path(source):
        return None if Path(source).expanduser().exists() else f"its dataset_path {source} does not exist"
    return _hub_problem(source)


def datasets_cache() -> Path:
    return hf_cache("HF_DATASETS_CACHE", "datasets")


@functools.cache
def _hub_away() -> str | None:
    """Why the hub cannot be reached from here (HF_HUB_OFFLINE, or no connection), once per process."""
    if offline():
        return "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set"
    host, port, what = hub_address()
    why = unreachable(host, port)
    return None if why is None else f"the hub cannot be reached from here ({what}: {why})"


def _hub_problem(dataset: str) -> str | None:
    if (datasets_cache() / dataset.replace("/", "___")).is_dir() or cached(dataset, "datasets"):  # downloaded before
        return None
    away = _hub_away()
    if away is None:
        return None
    return (
        f"its data is the Hugging Face hub dataset {dataset}, {away}, and it is not in the local datasets cache "
        f"({datasets_cache()}); give a task YAML whose data are local files (dataset_path: json, "
        "dataset_kwargs.data_files), or run where the hub can be reached once"
    )


@functools.cache
def _loads(path: str, stamp: str, group: bool) -> dict[str, Any] | str:
    """What lm-eval's TaskManager makes of this YAML (its data read too), or what it says when it cannot."""
    from lm_eval.tasks import TaskManager

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # datasets' progress bars while it reads the data
            return dict(TaskManager(include_defaults=group).load([path]))
    except Exception as err:
        return _load_error(Path(path), err)


def _load_error(path: Path, err: Exception) -> str:
    """lm-eval's failure to build a task, said with the data file and row at fault where they can be found."""
    cfg = _read_yaml(path)
    if type(err).__name__ == "UndefinedError":  # a template's field that no row has
        field_name = str(err).split("'")[1] if str(err).count("'") >= 2 else str(err)
        settings = [k for k in ("doc_to_text", "doc_to_target", "doc_to_choice") if field_name in str(cfg.get(k))]
        files = ", ".join(str(f) for f in _data_files(cfg)) or "its data"
        return (
            f"no row of {files} has the field {field_name}, which its {' and '.join(settings) or 'template'} reads; "
            "fix the field's name in the task YAML or in the data"
        )
    for data_file in _data_files(cfg):
        bad = _bad_row(data_file)
        if bad is not None:
            return f"its data file {data_file} cannot be read: {bad}; fix that row"
    error = f"{type(err).__name__}: {first_line(err)}"
    return f"lm-eval rejects this task YAML ({error}); fix it (lm-eval's docs/task_guide.md)"


def _bad_row(path: Path) -> str | None:
    """The first line of a JSON-lines data file that is not a JSON object (datasets says only that one failed)."""
    if path.suffix not in (".jsonl", ".json") or not path.is_file():
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        return first_line(err)
    if path.suffix == ".json" and text.lstrip()[:1] in ("[", "{"):
        try:
            json.loads(text)
        except ValueError as err:
            return f"it is not valid JSON ({first_line(err)})"
        return None
    for number, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else {}
        except ValueError as err:
            return f"line {number} is not valid JSON ({first_line(err)})"
        if not isinstance(row, dict):
            return f"line {number} holds a JSON {type(row).__name__}, not an object"
    return None


class _TaskLoader(yaml.SafeLoader):
    """lm-eval's task YAML: `!function module.name` is kept as its text (nothing of it is imported here)."""


_TaskLoader.add_constructor("!function", lambda loader, node: str(loader.construct_scalar(node)))


def _read_yaml(path: Path, seen: frozenset[Path] = frozenset()) -> dict[str, Any]:
    """A task YAML as lm-eval reads it: `include`d files first, its own keys over them."""
    try:
        cfg = yaml.load(path.read_text(), Loader=_TaskLoader)  # a SafeLoader with one tag added
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise TaskProblem(f"not a YAML file lm-eval can read ({first_line(err)})") from None
    if not isinstance(cfg, dict):
        raise TaskProblem(f"not an lm-eval task YAML: it holds a {type(cfg).__name__}, not a mapping")
    includes = cfg.pop("include", None)
    merged: dict[str, Any] = {}
    for include in includes if isinstance(includes, list) else [includes] if includes else []:
        target = (path.parent / str(include)).resolve()
        if target in seen:
            raise TaskProblem(f"its include {include} includes itself")
        merged.update({k: v for k, v in _read_yaml(target, seen | {target}).items() if k != "task_list"})
    return {**merged, **cfg}


def _metric_names(cfg: dict[str, Any]) -> tuple[str, ...]:
    listed = [m.get("metric") for m in cfg.get("metric_list") or [] if isinstance(m, dict)]
    metrics = [m for m in listed if isinstance(m, str)] or list(DEFAULT_METRICS.get(str(cfg.get("output_type")), ()))
    filters = [f.get("name") for f in cfg.get("filter_list") or [] if isinstance(f, dict)] or ["none"]
    if len(filters) == 1:
        return tuple(metrics)
    return tuple(m if f == "none" else f"{m}/{f}" for m in metrics for f in filters)


def _aggregate_names(cfg: dict[str, Any]) -> tuple[str, ...]:
    listed = [m for m in cfg.get("aggregate_metric_list") or [] if isinstance(m, dict)]
    return tuple(str(m["metric"]) for m in listed if isinstance(m.get("metric"), str))


def _an_index(found: dict[str, Any]) -> bool:
    return bool(found["tasks"]) and all(
        isinstance(v, list)
        and len(v) == 3
        and isinstance(v[0], str)
        and isinstance(v[1], (str, type(None)))
        and isinstance(v[2], list)
        for v in found["tasks"].values()
    )


@functools.cache
def registry_index() -> dict[str, list[Any]]:
    """lm-eval's task registry by name: [kind, YAML path, a tag's tasks], cached per lm-eval installation."""
    spec = importlib.util.find_spec("lm_eval")
    tasks_dir = Path(str(spec.origin if spec else "")).parent / "tasks"
    version = importlib.metadata.version("lm_eval")
    try:
        folder = private_dir(user_cache_dir())
    except UnsafePath as err:
        raise TaskProblem(f"lm-eval's task index cannot be kept: {err}") from None
    saved = folder / f"lm_eval_tasks-{version}-{hash_key(str(tasks_dir))}.json"
    found = cache_entry(saved, {"format": int, "tasks": dict}, valid=_an_index)
    if found is not None:
        return dict(found["tasks"])
    from lm_eval.tasks import TaskManager  # only to build the index (its import alone takes seconds)

    index = {
        name: [entry.kind.name, str(entry.yaml_path) if entry.yaml_path else None, sorted(entry.tags)]
        for name, entry in TaskManager().task_index.items()
    }
    with contextlib.suppress(OSError):
        write_json_atomic(saved, {"format": 1, "tasks": index})
    return index


def objective_problems(objective: str, tasks: list[str], lengths: tuple[int, ...], key: str) -> list[str]:
    """An objective `harness.<task>.<metric>` (an optuna study's) names a number the runs' scores will hold."""
    if not objective.startswith("harness."):
        return []
    if not tasks:
        return [f"{key}={objective}: the runs score no lm-eval task; set eval.harness.tasks=[...] for every trial"]
    specs, problems = resolve_tasks(tasks, lengths, key="eval.harness.tasks")
    if problems:
        return problems
    reported = [f"harness.{name}.{m}" for spec in specs for name, metrics in spec.metrics.items() for m in metrics]
    if objective in reported:
        return []
    return [f"{key}={objective}: the runs' lm-eval scores hold no such number; choose one of {', '.join(reported)}"]
