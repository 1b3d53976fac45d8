"""lm-evaluation-harness scores of exported models, through lm-eval's own Python API (nothing of its scoring is
redone here): each model is an HFLM of its directory (weights, tokenizer and dtype as exported), each TASK one
lm_eval.simple_evaluate call on it with the tasks of a TaskManager (ds_exp's built-ins generated into the data cache,
YAML files, lm-eval's registry), and lm-eval's EvaluationTracker writes its own files: results_<date>.json and the
per-sample outputs samples_<task>_<date>.jsonl.

Prompts are rendered as the run trained (`RenderedLM`, settings.template): the run's dschat markup, or the tokenizer's
chat template (lm-eval's apply_chat_template), or with the template off (or the run's raw template) lm-eval's own
prompts. The base model is scored the same way (ds_exp/artifacts/harness_base.py); harness.json, the console table
and the chart: ds_exp/artifacts/harness_report.py. lm-eval is an optional extra: this module imports it, and is
itself imported only where tasks are scored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lm_eval
import numpy as np
import torch
from lm_eval.api.instance import Instance
from lm_eval.loggers import EvaluationTracker
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from ds_exp.artifacts.harness_base import SCORES, BaseCache, base_identity, base_model_dir
from ds_exp.artifacts.harness_report import CHART, chart, harness_record, staged, write_record
from ds_exp.config.eval_schema import EvalConfig, HarnessConfig
from ds_exp.config.schema import Config
from ds_exp.data.cache import hash_key, path_fingerprint
from ds_exp.data.harness_tasks import BuiltinSettings, write_builtin_tasks
from ds_exp.exports.writer import TOKENIZER_FILES
from ds_exp.launch.harness_checks import TaskSpec, passkey_lengths
from ds_exp.launch.run_logging import FILE_LOGGER, LIBRARY_LOGGER
from ds_exp.runtime.rank_logging import library_stdout

log = logging.getLogger(__name__)
file_log = logging.getLogger(FILE_LOGGER)

APPLIED = ("dschat", "chat_template")  # the run's templates lm-eval's apply_chat_template renders


@dataclass(frozen=True)
class HarnessSettings:
    """How lm-eval is run: the same for the tuned model and its base (the base scores' cache key holds them)."""

    template: str | None  # dschat | chat_template: prompts rendered so; raw or None: lm-eval's own prompts
    limit: float | None = None
    num_fewshot: int | None = None
    batch_size: int = 8
    device: str = "cpu"
    gen_kwargs: dict[str, Any] | None = None  # the run's sampling for generation tasks; None: each task's (greedy)

    @property
    def applied(self) -> bool:
        return self.template in APPLIED

    def material(self) -> dict[str, Any]:
        limit = int(self.limit) if self.limit is not None and self.limit >= 1 else self.limit
        return {
            "template": self.template if self.applied else None,
            "limit": limit,
            "num_fewshot": self.num_fewshot,
            "batch_size": self.batch_size,
            "device": self.device.split(":")[0],
            "gen_kwargs": self.gen_kwargs,
            "lm_eval": lm_eval.__version__,
        }


@dataclass
class TaskScores:
    """One model's numbers for one TASK: result name (the task, a group's subtasks and itself) -> metric -> value."""

    values: dict[str, dict[str, float | None]] = field(default_factory=dict)
    stderr: dict[str, dict[str, float | None]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"values": self.values, "stderr": self.stderr}

    @classmethod
    def of(cls, record: dict[str, Any]) -> TaskScores:
        return cls(dict(record["values"]), dict(record["stderr"]))


class RenderedLM(HFLM):
    """lm-eval's HFLM, asking in the run's template. dschat (no chat template in the tokenizer) is rendered as the run
    trained on it: " Human: {question} Assistant: {answer}", the space before the answer left at the end of the
    context, which lm-eval moves into the continuation (the answer's tokens are the ones trained on), and stripped
    before generating (the model writes it, as in training). chat_template: the tokenizer's own, as HFLM applies it."""

    def __init__(self, *args: Any, template: str | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.template = template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.template != "dschat":
            return str(super().apply_chat_template(chat_history, add_generation_prompt))
        heads = {"user": " Human: ", "assistant": " Assistant: ", "system": ""}
        text = "".join(heads.get(turn["role"], "") + turn["content"] for turn in chat_history)
        return text + (" Assistant: " if add_generation_prompt else "")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if self.template == "dschat":
            return "ds_exp dschat: ' Human: {user} Assistant: {assistant}'"
        return super().chat_template(chat_template)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        if self.template == "dschat":
            for request in requests:
                context, *rest = request.arguments
                request.arguments = (str(context).rstrip(" "), *rest)
        return list(super().generate_until(requests, disable_tqdm=disable_tqdm))


def load_model(model_dir: Path, settings: HarnessSettings, *, tokenizer_dir: Path | None = None) -> RenderedLM:
    """The model as lm-eval scores it (loaded once for all its tasks)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # lm-eval's CLI sets it too
    with library_stdout(stderr=True):
        return RenderedLM(
            pretrained=str(model_dir),
            tokenizer=str(tokenizer_dir or model_dir),
            device=settings.device,
            batch_size=settings.batch_size,
            dtype="auto",
            template=settings.template if settings.applied else None,
        )


def task_manager(specs: Sequence[TaskSpec], builtin_dir: Path | None) -> TaskManager:
    """lm-eval's registry only when a TASK is one of its names (reading it takes seconds); the built-ins' directory."""
    registry = any(spec.kind == "registry" for spec in specs)
    return TaskManager(include_defaults=registry, include_path=str(builtin_dir) if builtin_dir else None)


def score(
    lm: RenderedLM, specs: Sequence[TaskSpec], settings: HarnessSettings, manager: TaskManager, out_dir: Path
) -> dict[str, TaskScores]:
    """Each TASK's scores (by its given name), lm-eval's files for it in out_dir/<task>/."""
    scores = {}
    for spec in specs:
        tracker = EvaluationTracker(output_path=str(out_dir / spec.name / "results.json"))
        with library_stdout(stderr=True):
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=[spec.request],
                task_manager=manager,
                limit=int(settings.limit) if settings.limit is not None and settings.limit >= 1 else settings.limit,
                num_fewshot=settings.num_fewshot,
                apply_chat_template=settings.applied,
                fewshot_as_multiturn=settings.applied,
                gen_kwargs=settings.gen_kwargs,
                log_samples=True,
                evaluation_tracker=tracker,
            )
            assert results is not None  # rank 0 (the only one here)
            samples = results.pop("samples")
            tracker.save_results_aggregated(results=results, samples=samples)
            for task in samples:
                tracker.save_results_samples(task_name=task, samples=samples[task])
        scores[spec.given] = scores_of(results["results"])
        file_log.info("lm-eval %s: %s", spec.given, scores[spec.given].values)
    return scores


def scores_of(results: dict[str, dict[str, Any]]) -> TaskScores:
    """lm-eval's results ({"acc,none": 0.9, "acc_stderr,none": 0.02, ...} per task) as harness.json names them: a
    metric under the filter `none`, or its only filter, by its own name; else `<metric>/<filter>`."""
    out = TaskScores()
    for task, values in results.items():
        keyed = [(str(k).split(",", 1), v) for k, v in values.items() if "," in str(k)]
        filters: dict[str, set[str]] = {}
        for (metric, filt), _ in keyed:
            if not metric.endswith("_stderr"):
                filters.setdefault(metric, set()).add(filt)
        out.values[task], out.stderr[task] = {}, {}
        for (metric, filt), value in keyed:
            if metric.endswith("_stderr"):
                continue
            name = metric if filt == "none" or len(filters[metric]) == 1 else f"{metric}/{filt}"
            out.values[task][name] = _number(value)
            out.stderr[task][name] = _number(values.get(f"{metric}_stderr,{filt}"))
    return out


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):  # lm-eval's "N/A" stderr, a dict of sample counts
        return None


# ------------------------------------------------------------------------------------------- a whole evaluation


@dataclass
class Evaluation:
    record: dict[str, Any]  # harness.json
    directory: Path  # where it was written
    base_scored: list[str] = field(default_factory=list)  # the TASKs whose base scores were computed (not cached)


def evaluate(
    tuned_dir: Path,
    specs: Sequence[TaskSpec],
    settings: HarnessSettings,
    *,
    out_dir: Path,
    cache_dir: Path,
    builtin: BuiltinSettings,
    base_cfg: Config | None,
    title: str,
) -> Evaluation:
    """Score the export `tuned_dir` (and with `base_cfg`, the run's config, its base model) on every TASK; write
    harness.json, the chart and lm-eval's files into `out_dir`. Training's random state is left as it was."""
    hf_logging.disable_progress_bar()  # loading and writing shards: ds_exp says what it does instead
    with _random_state_kept(), staged(out_dir) as scratch, _lm_eval_log(scratch / "lm_eval.log"):
        started = time.perf_counter()
        builtin_dir = _builtin_tasks(specs, tuned_dir, cache_dir, builtin)
        manager = task_manager(specs, builtin_dir)
        keyed = [_keyed(spec, builtin_dir) for spec in specs]
        timing = {"tasks_s": time.perf_counter() - started}
        tuned = score(load_model(tuned_dir, settings), keyed, settings, manager, scratch / "tuned")
        timing["tuned_s"] = time.perf_counter() - started - timing["tasks_s"]
        base: dict[str, TaskScores] | None = None
        scored: list[str] = []
        if base_cfg is not None:
            cache = BaseCache(cache_dir, base_identity(base_cfg, tuned_dir), settings.material())
            base, scored = base_scores(base_cfg, tuned_dir, keyed, settings, manager, cache, scratch / "base")
            timing["base_s"] = time.perf_counter() - started - timing["tasks_s"] - timing["tuned_s"]
        record = harness_record(_pairs(tuned, keyed), _pairs(base, keyed) if base else None, _shown(settings, specs))
        record["settings"].update(model=str(tuned_dir), base_scored=scored if base_cfg is not None else None)
        record["timing"] = timing  # seconds: the built-in tasks' files, the tuned model, the base (or its cache)
        write_record(scratch, record)
        chart(record, scratch / CHART, title)
    return Evaluation(record, out_dir, scored)


def base_scores(
    cfg: Config,
    tuned_dir: Path,
    specs: Sequence[TaskSpec],
    settings: HarnessSettings,
    manager: TaskManager,
    cache: BaseCache,
    out_dir: Path,
) -> tuple[dict[str, TaskScores], list[str]]:
    """(the base model's scores by TASK, the TASKs scored now): from the cache where it has them, else scored (one
    process at a time) and cached; lm-eval's files of each TASK copied into out_dir/<task>/."""
    found = {spec.given: cache.read(spec.fingerprint) for spec in specs}
    scored: list[str] = []
    if any(v is None for v in found.values()):
        with cache.lock():
            found = {spec.given: cache.read(spec.fingerprint) for spec in specs}  # another job's, meanwhile
            missing = [spec for spec in specs if found[spec.given] is None]
            if missing:
                scratch = cache.scratch()
                try:
                    how = f"from {cfg.model.name_or_path}" if cfg.model.name_or_path else "built from model.arch"
                    log.info("the base model (%s, train.seed=%d): scoring %s", how, cfg.train.seed, _names(missing))
                    with base_model_dir(cfg, tuned_dir, scratch) as base_dir:
                        lm = load_model(base_dir, settings, tokenizer_dir=tuned_dir)
                        scores = score(lm, missing, settings, manager, scratch / "files")
                        del lm
                    for spec in missing:
                        cache.store(spec.fingerprint, scratch / "files" / spec.name, scores[spec.given].as_json())
                        found[spec.given] = scores[spec.given].as_json()
                        scored.append(spec.given)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
    for spec in specs:
        shutil.copytree(cache.entry(spec.fingerprint), out_dir / spec.name, ignore=shutil.ignore_patterns(SCORES))
    return {given: TaskScores.of(record) for given, record in found.items() if record is not None}, scored


def _pairs(
    scores: dict[str, TaskScores], specs: Sequence[TaskSpec]
) -> dict[str, dict[str, tuple[float | None, float | None]]]:
    out: dict[str, dict[str, tuple[float | None, float | None]]] = {}
    for spec in specs:
        found = scores[spec.given]
        for task, metrics in found.values.items():
            out[task] = {metric: (value, found.stderr[task].get(metric)) for metric, value in metrics.items()}
    return out


def _names(specs: Sequence[TaskSpec]) -> str:
    return ", ".join(spec.given for spec in specs)


def _shown(settings: HarnessSettings, specs: Sequence[TaskSpec]) -> dict[str, Any]:
    return {"tasks": [spec.given for spec in specs], **settings.material()}


def _keyed(spec: TaskSpec, builtin_dir: Path | None) -> TaskSpec:
    """A built-in's cache key holds what it was generated from (its directory in the data cache is named by it)."""
    if spec.kind != "builtin" or builtin_dir is None:
        return spec
    return dataclasses.replace(spec, fingerprint=f"{spec.fingerprint}:{builtin_dir.name}")


def _builtin_tasks(
    specs: Sequence[TaskSpec], tuned_dir: Path, cache_dir: Path, builtin: BuiltinSettings
) -> Path | None:
    names = [spec.name for spec in specs if spec.kind == "builtin"]
    if not names:
        return None
    tokenizer = AutoTokenizer.from_pretrained(str(tuned_dir))
    files = {name: path_fingerprint(tuned_dir / name) for name in TOKENIZER_FILES if (tuned_dir / name).is_file()}
    settings = dataclasses.replace(builtin, tokenizer_id=hash_key(files))
    return write_builtin_tasks(names, cache_dir, settings, lambda text: len(tokenizer(text)["input_ids"]))


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """lm-eval seeds Python's, numpy's and torch's generators (and the base's rebuild torch's): put back after."""
    python, numpy_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy_state)


@contextlib.contextmanager
def _lm_eval_log(path: Path) -> Iterator[None]:
    """What lm-eval says (its logger, and what it prints: ds_exp.runtime.rank_logging.library_stdout) also goes to
    `path`, beside its files."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in (LIBRARY_LOGGER, FILE_LOGGER, "lm_eval")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
        handler.close()


def settings_of(
    harness: HarnessConfig, sampling: EvalConfig | None, template: str | None, device: str
) -> HarnessSettings:
    """eval.harness's settings for an export asked in `template` (the run's: its export's metadata says it) on
    `device`; generation tasks sample as the run's generations did (`sampling`: eval.*, greedy by default)."""
    gen_kwargs = None
    if sampling is not None and sampling.temperature > 0:
        gen_kwargs = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p}
        gen_kwargs |= {"top_k": sampling.top_k} if sampling.top_k > 0 else {}
    return HarnessSettings(
        template=template if harness.template else None,
        limit=harness.limit,
        num_fewshot=harness.num_fewshot,
        batch_size=int(harness.batch_size),
        device=device,
        gen_kwargs=gen_kwargs,
    )


def builtin_of(cfg: Config) -> BuiltinSettings:
    return BuiltinSettings(cfg.data.synthetic, passkey_lengths(cfg))
