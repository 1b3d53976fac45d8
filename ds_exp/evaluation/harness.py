"""lm-evaluation-harness scores of exported models, through lm-eval's own Python API (nothing of its scoring is
redone here): each model is an HFLM of its directory (weights, tokenizer and dtype as exported), each TASK one
lm_eval.simple_evaluate call on it with the tasks of a TaskManager (the built-ins of tasks.py, YAML files, lm-eval's
registry), and lm-eval's EvaluationTracker writes its own files (results_<date>.json, samples_<task>_<date>.jsonl).
Prompts are rendered as the run trained (`RenderedLM`): the run's dschat markup, or the tokenizer's chat template
(lm-eval's apply_chat_template), or with the template off (or the run's raw template) lm-eval's own prompts.

The base model is scored the same way: what the run's config builds before training (ds_exp.model.build, the run's
own call), the pretrained checkpoint or, for a model built from its config, its initialization rebuilt from
train.seed (init_weights_by_name draws every module's weights from (train.seed, its name) alone: the run's step-0
model at any ZeRO stage and world size; tests/integration/test_harness.py checks its perplexity), exported as the run
exports (the tuned export's vocabulary, dtype and tokenizer) into a scratch directory; a checkpoint the export kept
as it was is scored in place. Its scores are cached under data.cache_dir, one entry per (model, TASK, settings),
written whole under a lock: a sweep of 20 jobs over one base model scores it once, and a rerun not at all.

lm-eval is an optional extra: this module imports it, and is itself imported only where tasks are scored (a run's
hooks.py; `run`, `python -m ds_exp.evaluate`'s work).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import shutil
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lm_eval
import numpy as np
import torch
import transformers
from lm_eval.api.instance import Instance
from lm_eval.loggers import EvaluationTracker
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import logging as hf_logging

from ds_exp.config.paths import data_cache_dir
from ds_exp.config.schema import Config, DataConfig, EvalConfig, ModelConfig
from ds_exp.core.files import json_text
from ds_exp.data.cache import file_lock, hash_key, path_fingerprint
from ds_exp.data.templates import has_chat_template
from ds_exp.evaluation.checks import TaskSpec
from ds_exp.evaluation.plan import Plan
from ds_exp.evaluation.report import HARNESS_JSON, harness_record, staged, table, write_record
from ds_exp.evaluation.settings import HarnessConfig
from ds_exp.evaluation.tasks import BuiltinSettings, write_builtin_tasks
from ds_exp.exports.checks import run_dir_of
from ds_exp.exports.on_disk import read_metadata
from ds_exp.exports.writer import DTYPES, TOKENIZER_FILES, export_checkpoint, export_spec, write_export
from ds_exp.launch.run_logging import FILE_LOGGER, LIBRARY_LOGGER
from ds_exp.model.architecture import checkpoint_dtype
from ds_exp.model.build import build_model
from ds_exp.model.tokenizer import load_tokenizer
from ds_exp.runtime.rank_logging import library_stdout

log = logging.getLogger(__name__)
file_log = logging.getLogger(FILE_LOGGER)

APPLIED = ("dschat", "chat_template")  # the run's templates lm-eval's apply_chat_template renders
CACHE = "harness-base"  # the base model's scores, under data.cache_dir
SCORES = "scores.json"
WRITTEN_BY = "ds_exp harness: the base model"


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

    @property
    def questions(self) -> float | None:
        """lm-eval's limit: a number of questions (>= 1), or a fraction of them."""
        return int(self.limit) if self.limit is not None and self.limit >= 1 else self.limit

    def material(self) -> dict[str, Any]:
        return {
            "template": self.template if self.applied else None,
            "limit": self.questions,
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
                limit=settings.questions,
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
        registry = any(spec.kind == "registry" for spec in specs)  # lm-eval's registry takes seconds to read
        manager = TaskManager(include_defaults=registry, include_path=str(builtin_dir) if builtin_dir else None)
        keyed = [_keyed(spec, builtin_dir) for spec in specs]
        timing = {"tasks_s": time.perf_counter() - started}
        tuned = score(load_model(tuned_dir, settings), keyed, settings, manager, scratch / "tuned")
        timing["tuned_s"] = time.perf_counter() - started - timing["tasks_s"]
        base: dict[str, TaskScores] | None = None
        scored: list[str] = []
        if base_cfg is not None:
            identity = base_identity(base_cfg.model, base_cfg.train.seed, tuned_dir)
            cache = BaseCache(cache_dir, identity, settings.material())
            base, scored = base_scores(base_cfg, tuned_dir, keyed, settings, manager, cache, scratch / "base")
            timing["base_s"] = time.perf_counter() - started - timing["tasks_s"] - timing["tuned_s"]
        shown = {"tasks": [spec.given for spec in specs], **settings.material()}
        record = harness_record(_pairs(tuned, keyed), _pairs(base, keyed) if base else None, shown)
        record["settings"].update(model=str(tuned_dir), base_scored=scored if base_cfg is not None else None)
        record["timing"] = timing  # seconds: the built-in tasks' files, the tuned model, the base (or its cache)
        write_record(scratch, record, title)
    return Evaluation(record, scored)


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
                    names = ", ".join(spec.given for spec in missing)
                    log.info("the base model (%s, train.seed=%d): scoring %s", how, cfg.train.seed, names)
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
    settings = dataclasses.replace(builtin, tokenizer_id=hash_key(_tokenizer_files(tuned_dir)))
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
    return BuiltinSettings(cfg.data.synthetic, cfg.eval.harness.lengths(cfg.data.max_seq_len))


def _tokenizer_files(model_dir: Path) -> dict[str, Any]:
    return {name: path_fingerprint(model_dir / name) for name in TOKENIZER_FILES if (model_dir / name).is_file()}


# ---------------------------------------------------------------------------------------------- the base model


def base_identity(model: ModelConfig, seed: int, tuned_dir: Path) -> dict[str, Any]:
    """What the base model's scores depend on: how it is built (from model.arch and train.seed `seed`, or the
    checkpoint's files), the tokenizer and dtype the tuned export has."""
    if model.name_or_path is None:
        built: dict[str, Any] = {
            "arch": model.arch,
            "seed": seed,
            "vocab_multiple": model.vocab_multiple,
            "built_with": [torch.__version__, transformers.__version__],  # their init code draws the weights
        }
    else:
        path = Path(model.name_or_path).expanduser()
        built = (
            {"checkpoint": str(path.resolve()), "files": path_fingerprint(path)}
            if path.exists()
            else {"hub": model.name_or_path}
        )
    return {"model": built, "tokenizer": _tokenizer_files(tuned_dir), "dtype": read_metadata(tuned_dir).get("dtype")}


def _for_rebuild(cfg: Config) -> Config:
    """The run's config for the base alone, in this process: no LoRA (its adapters start as the identity), no
    sequence-parallel groups, no GPU kernels, no long-context tiling (none of them changes a weight)."""
    cfg = dataclasses.replace(cfg)
    cfg.lora = dataclasses.replace(cfg.lora, dim=0, quantize=None)
    cfg.dist = dataclasses.replace(cfg.dist, sequence_parallel_size=1)
    attention = None if cfg.model.attn_implementation == "auto" else cfg.model.attn_implementation
    cfg.model = dataclasses.replace(
        cfg.model,
        liger_kernel=False,
        attn_implementation=attention,
        gradient_checkpointing=False,
        tiled_mlp=False,
        tiled_loss=False,
        activation_offload=False,
    )
    return cfg


@contextlib.contextmanager
def base_model_dir(cfg: Config, tuned_dir: Path, scratch: Path) -> Iterator[Path]:
    """A directory lm-eval loads the base model from: the checkpoint itself, or an export of the rebuilt model
    written under `scratch` (removed after)."""
    meta = read_metadata(tuned_dir)
    path = cfg.model.name_or_path
    if path is not None and Path(path).expanduser().is_dir():  # the checkpoint itself, when the export kept its
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)  # vocabulary, dtype
        rows = int(getattr(config.get_text_config(), "vocab_size", 0) or 0)
        if meta.get("vocab_size") == rows and meta.get("dtype") == checkpoint_dtype(cfg.model):
            yield Path(path).expanduser()
            return
    generation = meta.get("generation") or {}
    rebuilt = _for_rebuild(cfg)
    tokenizer = load_tokenizer(rebuilt.model, rebuilt.data)
    built = build_model(rebuilt, tokenizer, {"zero_optimization": {"stage": 0}})
    state = dict(built.model.state_dict())
    spec = export_spec(
        rebuilt.model,
        built,
        "fp32",
        template=generation.get("template"),
        stop_token_ids=tuple(generation.get("stop_token_ids") or ()),
        origin={"written_by": WRITTEN_BY, "model": cfg.model.name_or_path or f"{cfg.model.name}, train.seed"},
    )
    names = {name: key for key, name in DTYPES.items()}
    spec = dataclasses.replace(spec, dtype=names.get(str(meta.get("dtype")), "fp32"))  # the tuned export's
    # built from a config, every weight comes from the rebuild; a checkpoint's are copied from it exactly
    trained = set(state) if cfg.model.name_or_path is None else set()
    del built
    target = scratch / f".base-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_export(state, trained, spec, tokenizer, target)
        yield target
    finally:
        shutil.rmtree(target, ignore_errors=True)


class BaseCache:
    """The base model's scores under <data.cache_dir>/harness-base/: <model>-<task and settings>/ holds
    scores.json and lm-eval's files for that TASK. An entry is complete once its directory has its name."""

    def __init__(self, cache_dir: Path, identity: dict[str, Any], settings: dict[str, Any]) -> None:
        self.root = cache_dir / CACHE
        self.model_key = hash_key(identity)
        self.settings = settings

    def entry(self, fingerprint: str) -> Path:
        return self.root / f"{self.model_key}-{hash_key([fingerprint, self.settings])}"

    def read(self, fingerprint: str) -> dict[str, Any] | None:
        try:
            found = json.loads((self.entry(fingerprint) / SCORES).read_text())
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One process scores a base model at a time (the jobs of a sweep started together wait, then read)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with file_lock(self.root / f"{self.model_key}.lock"):
            yield

    def scratch(self) -> Path:
        path = self.root / f".{self.model_key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path

    def store(self, fingerprint: str, files: Path, scores: dict[str, Any]) -> None:
        """`files` (lm-eval's, for this TASK) and `scores` become the entry (renamed into place: complete or absent)."""
        (files / SCORES).write_text(json_text(scores, indent=2, sort_keys=True) + "\n")
        target = self.entry(fingerprint)
        if target.exists():
            shutil.rmtree(target)
        files.rename(target)


# ------------------------------------------------------------------------------------- python -m ds_exp.evaluate


def run(plan: Plan) -> int:
    """Score what `plan` says (a checkpoint exported first) and print the table."""
    hf_logging.disable_progress_bar()
    if plan.checkpoint is not None:
        assert plan.cfg is not None  # a checkpoint's run config rebuilds its model
        print(f"ds_exp: exporting {plan.checkpoint} to {plan.model_dir} first", file=sys.stderr)
        run_dir = run_dir_of(plan.checkpoint)
        export_checkpoint(plan.checkpoint, run_dir, plan.cfg, plan.model_dir, adapter=False, dtype=None)
    device = plan.harness.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = settings_of(plan.harness, plan.cfg.eval if plan.cfg else None, template_of(plan.model_dir), device)
    data = plan.cfg.data if plan.cfg is not None else DataConfig(name="synthetic")  # the embedded task's defaults
    what = f"{plan.model_dir} and its base model" if plan.base else str(plan.model_dir)
    asked = f"prompts in the {settings.template} template" if settings.applied else "lm-eval's own prompts"
    print(f"ds_exp: scoring {what} on {', '.join(s.given for s in plan.specs)} ({asked}, {device})", file=sys.stderr)
    evaluation = evaluate(
        plan.model_dir,
        plan.specs,
        settings,
        out_dir=plan.out_dir,
        cache_dir=data_cache_dir(data.cache_dir),
        builtin=BuiltinSettings(data.synthetic, plan.harness.lengths(data.max_seq_len)),
        base_cfg=plan.cfg if plan.base else None,
        title=str(plan.model_dir),
    )
    print(table(evaluation.record))
    cached = " (the base model's scores from the cache)" if plan.base and not evaluation.base_scored else ""
    print(f"ds_exp: scores in {plan.out_dir / HARNESS_JSON}{cached}, chart harness.png, lm-eval's samples beside")
    return 0


def template_of(model_dir: Path) -> str | None:
    """How the model is asked: the run's template (its export says it), else the tokenizer's chat template, else
    lm-eval's own prompts (a model from elsewhere, trained on none)."""
    recorded = (read_metadata(model_dir).get("generation") or {}).get("template")
    if recorded is not None:
        return str(recorded)
    return "chat_template" if has_chat_template(AutoTokenizer.from_pretrained(str(model_dir))) else None
