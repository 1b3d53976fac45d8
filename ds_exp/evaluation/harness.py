"""lm-evaluation-harness scores of exported models through lm-eval's own API: an HFLM of each model, one simple_evaluate
per TASK, prompts rendered as the run trained (`RenderedLM`). The base model (the checkpoint, or its init rebuilt from
train.seed) is scored once per (model, TASK, settings), cached under data.cache_dir under a lock. Imported only where
tasks are scored."""

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
from typing import Any, TextIO

import lm_eval
import numpy as np
import torch
import transformers
from lm_eval.api.instance import Instance
from lm_eval.loggers import EvaluationTracker
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import logging as hf_logging

from ds_exp.config.paths import data_cache_dir
from ds_exp.config.schema import Config, DataConfig, EvalConfig, ModelConfig
from ds_exp.config.secrets import redact, redact_text
from ds_exp.core.errors import ConfigError, RunFailed
from ds_exp.core.files import json_text, write_text_atomic
from ds_exp.core.private_files import UnsafePath, cache_entry, check_own, private_dir
from ds_exp.data.cache import disk_full, file_lock, hash_key, path_fingerprint
from ds_exp.data.templates import has_chat_template
from ds_exp.evaluation.checks import TaskSpec
from ds_exp.evaluation.fit import CLI_KEYS, Asked, ModelFit, check_room, loaded_problems, positions_of
from ds_exp.evaluation.plan import Plan
from ds_exp.evaluation.report import HARNESS_JSON, few_questions, harness_record, staged, table, write_record
from ds_exp.evaluation.settings import HarnessConfig
from ds_exp.evaluation.tasks import BuiltinSettings, write_builtin_tasks
from ds_exp.exports.checks import run_dir_of
from ds_exp.exports.on_disk import read_metadata
from ds_exp.exports.writer import DTYPES, TOKENIZER_FILES, export_checkpoint, export_spec, rebuild_config, write_export
from ds_exp.launch.run_logging import FILE_LOGGER, LIBRARY_LOGGER, ConsoleFormatter, on_terminal
from ds_exp.model.architecture import checkpoint_dtype
from ds_exp.model.build import build_model
from ds_exp.model.tokenizer import load_tokenizer
from ds_exp.runtime.rank_logging import library_stdout
from ds_exp.train.metrics import PlainProgress

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
    keys: dict[str, str] = field(default_factory=dict)  # what a refusal names (fit.Asked): the command's flags

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
    questions: dict[str, int] = field(default_factory=dict)  # result name -> the questions its score rests on

    def as_json(self) -> dict[str, Any]:
        return {"values": self.values, "stderr": self.stderr, "questions": self.questions}

    @classmethod
    def of(cls, record: dict[str, Any]) -> TaskScores:
        return cls(dict(record["values"]), dict(record["stderr"]), dict(record["questions"]))

    @staticmethod
    def valid(record: dict[str, Any]) -> bool:
        """A cache entry's shape: what as_json writes (another is a miss: private_files.cache_entry)."""
        numbers = all(
            isinstance(record[side].get(task), dict)
            and all(isinstance(v, (int, float, type(None))) for v in record[side][task].values())
            for side in ("values", "stderr")
            for task in record["values"]
        )
        return numbers and all(isinstance(n, int) for n in record["questions"].values())


class RenderedLM(HFLM):
    """lm-eval's HFLM asking in the run's template (dschat as trained, the answer's leading space left to the model)."""

    def __init__(self, *args: Any, template: str | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.template = template
        self.progress: Progress | None = None  # the requests of the task being scored, on the console

    def _counted(self, requests: list[Instance], score: Any) -> Any:
        if self.progress is None:
            return score()
        self.progress.start(len(requests))
        try:
            return score()
        finally:
            self.progress.done()

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return list(self._counted(requests, lambda: super(RenderedLM, self).loglikelihood(requests, disable_tqdm)))

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        return list(
            self._counted(requests, lambda: super(RenderedLM, self).loglikelihood_rolling(requests, disable_tqdm))
        )

    def _model_call(self, inps: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = super()._model_call(inps, *args, **kwargs)
        if self.progress is not None:
            self.progress.advance(int(inps.shape[0]))  # one row of a batch per request (a context's group: fewer)
        return logits

    def _model_generate(self, context: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super()._model_generate(context, *args, **kwargs)
        if self.progress is not None:
            self.progress.advance(int(context.shape[0]))
        return out

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
        return list(self._counted(requests, lambda: super(RenderedLM, self).generate_until(requests, disable_tqdm)))


class Progress:
    """Requests scored while lm-eval scores one TASK: a bar on a terminal, else plain lines, on the original console."""

    def __init__(self, what: str) -> None:
        self.what, self.terminal = what, on_terminal()
        handlers = [*logging.getLogger("ds_exp").handlers, *logging.getLogger().handlers]
        said = [
            h for h in handlers if isinstance(h, logging.StreamHandler) and isinstance(h.formatter, ConsoleFormatter)
        ]
        stream: TextIO = sys.stderr if self.terminal or not said else said[0].stream
        # a copy of the console's descriptor: library_stdout points descriptors 1 and 2 at the log while lm-eval runs
        self.console, self.own = stream, False
        with contextlib.suppress(AttributeError, OSError, ValueError):  # none (a test's capture): the stream itself
            self.console, self.own = os.fdopen(os.dup(stream.fileno()), "w", buffering=1), True
        self.bar: tqdm | None = None
        self.plain: PlainProgress | None = None
        self.count = 0

    def start(self, total: int) -> None:
        self.count = 0
        if self.terminal:
            self.bar = tqdm(total=total, desc=self.what, unit="req", file=self.console, dynamic_ncols=True)
        else:
            self.plain = PlainProgress(total, 0)

    def advance(self, n: int) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(min(n, self.bar.total - self.bar.n))
        elif self.plain is not None and self.plain.due(min(self.count, self.plain.total)):
            self._say(min(self.count, self.plain.total))

    def done(self) -> None:
        if self.bar is not None:
            self.bar.update(self.bar.total - self.bar.n)
            self.bar.close()
        elif self.plain is not None and self.plain.said_tenth < 10:
            self._say(self.plain.total)
        self.bar = self.plain = None

    def _say(self, count: int) -> None:
        assert self.plain is not None
        line = f"ds_exp: {self.what}: requests {self.plain.progress(count)}{self.plain.left(count)}"
        print(redact_text(line), file=self.console, flush=True)

    def close(self) -> None:
        if self.own:
            self.console.close()


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
    lm: RenderedLM,
    specs: Sequence[TaskSpec],
    settings: HarnessSettings,
    manager: TaskManager,
    out_dir: Path,
    model: str = "",
) -> dict[str, TaskScores]:
    """Each TASK's scores (by its given name), lm-eval's files for it in out_dir/<task>/, redacted."""
    scores = {}
    for spec in specs:
        tracker = EvaluationTracker(output_path=str(out_dir / spec.name / "results.json"))
        lm.progress = Progress(f"scoring {spec.name}" + (f" ({model})" if model else ""))
        with contextlib.closing(lm.progress), library_stdout(stderr=True):
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
        redact_files(out_dir / spec.name)
        scores[spec.given] = scores_of(results)
        file_log.info("lm-eval %s: %s", spec.given, scores[spec.given].values)
    return scores


def redact_files(where: Path) -> None:
    """lm-eval's files (under `where`, or that file) redacted: its results copy each task's config (tokens included)."""
    for path in [where] if where.is_file() else sorted(p for p in where.rglob("*") if p.is_file()):
        text = path.read_text(errors="replace")
        if path.suffix in (".json", ".jsonl"):
            one = path.suffix == ".json"
            rows = [json.loads(text)] if one else [json.loads(line) for line in text.splitlines() if line.strip()]
            blanked = [redact(row) for row in rows]
            if blanked != rows:
                lines = [json_text(row, indent=2 if one else None, ensure_ascii=False) for row in blanked]
                write_text_atomic(path, "\n".join(lines) + "\n")
        elif (done := "".join(redact_text(line) for line in text.splitlines(keepends=True))) != text:
            write_text_atomic(path, done)


def scores_of(found: dict[str, Any]) -> TaskScores:
    """lm-eval's results as harness.json names them (`<metric>` or `<metric>/<filter>`), and each one's questions."""
    out = TaskScores()
    results: dict[str, dict[str, Any]] = found["results"]
    counted = {task: int(n.get("effective", 0)) for task, n in (found.get("n-samples") or {}).items()}
    groups: dict[str, list[str]] = found.get("group_subtasks") or {}
    for task in results:
        out.questions[task] = counted.get(task, sum(counted.get(t, 0) for t in groups.get(task, ())))
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
    """Score `tuned_dir` (with `base_cfg`, its base too) on every TASK into `out_dir`; training's random state kept."""
    hf_logging.disable_progress_bar()  # loading and writing shards: ds_exp says what it does instead
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"{settings.keys.get('device', 'eval.harness.device')}={settings.device}: torch sees no "
            "CUDA device here; use cpu or auto"
        )
    try:
        with _random_state_kept(), staged(out_dir) as scratch, _lm_eval_log(scratch / "lm_eval.log"):
            started = time.perf_counter()
            tokenizer = AutoTokenizer.from_pretrained(str(tuned_dir))
            builtin_dir = _builtin_tasks(specs, tokenizer, tuned_dir, cache_dir, builtin)
            registry = any(spec.kind == "registry" for spec in specs)  # lm-eval's registry takes seconds to read
            manager = TaskManager(include_defaults=registry, include_path=str(builtin_dir) if builtin_dir else None)
            keyed = [_keyed(spec, builtin_dir) for spec in specs]
            cache = None
            if base_cfg is not None:  # checked now: the user's own directory (ds_exp/core/private_files.py)
                identity = base_identity(base_cfg.model, base_cfg.train.seed, tuned_dir)
                cache = BaseCache(cache_dir, identity, settings.material())
            size = judged(tuned_dir, tokenizer, keyed, settings, manager)  # before any weight loads
            check_room(out_dir, settings.keys.get("output", "hydra.run.dir"), size * (2 if cache else 1))
            timing = {"tasks_s": time.perf_counter() - started}
            lm = load_model(tuned_dir, settings)
            tuned = score(lm, keyed, settings, manager, scratch / "tuned", "the tuned model" if cache else "")
            del lm
            timing["tuned_s"] = time.perf_counter() - started - timing["tasks_s"]
            base: dict[str, TaskScores] | None = None
            scored: list[str] = []
            if base_cfg is not None and cache is not None:
                base, scored = base_scores(base_cfg, tuned_dir, keyed, settings, manager, cache, scratch / "base")
                timing["base_s"] = time.perf_counter() - started - timing["tasks_s"] - timing["tuned_s"]
            shown = {"tasks": [spec.given for spec in specs], **settings.material()}
            record = harness_record(_pairs(tuned, keyed), _pairs(base, keyed) if base else None, shown)
            record["settings"].update(model=str(tuned_dir), base_scored=scored if base_cfg is not None else None)
            record["questions"] = {task: n for spec in keyed for task, n in tuned[spec.given].questions.items()}
            record["timing"] = timing  # seconds: the built-in tasks' files, the tuned model, the base (or its cache)
            write_record(scratch, record, title)
        redact_files(out_dir / "lm_eval.log")  # what lm-eval logged (its records are blanked as they are made)
    except OSError as err:
        code = disk_full(err)
        if code is None:
            raise
        raise RunFailed(
            f"{out_dir}: the disk filled up while the evaluation wrote its files ({os.strerror(code)}); nothing of "
            "it was kept: free some space and score again"
        ) from err
    return Evaluation(record, scored)


def judged(
    tuned_dir: Path, tokenizer: Any, specs: Sequence[TaskSpec], settings: HarnessSettings, manager: TaskManager
) -> int:
    """Every TASK's rows against the export (fit.py) before any weight loads: ConfigError, else lm-eval's bytes."""
    config = AutoConfig.from_pretrained(str(tuned_dir)).to_dict()
    positions = positions_of(config, {"model_max_length": getattr(tokenizer, "model_max_length", None)})
    counted = lambda texts: [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]  # noqa: E731
    model = ModelFit(str(tuned_dir), positions, counted)
    asked = Asked(settings.questions, settings.num_fewshot, settings.keys)
    problems: list[str] = []
    size = 0
    for spec in specs:
        with library_stdout(stderr=True):  # datasets' bars, lm-eval's notices: the log's
            loaded = dict(manager.load([spec.request]))
        more, written = loaded_problems(spec.given, loaded, model, asked, key=asked.key("tasks"), run_code=True)
        problems, size = problems + more, size + written
    if problems:
        raise ConfigError(problems)
    return size


def base_scores(
    cfg: Config,
    tuned_dir: Path,
    specs: Sequence[TaskSpec],
    settings: HarnessSettings,
    manager: TaskManager,
    cache: BaseCache,
    out_dir: Path,
) -> tuple[dict[str, TaskScores], list[str]]:
    """(the base model's scores by TASK, the TASKs scored now): cached, else scored under a lock and cached."""
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
                        scores = score(lm, missing, settings, manager, scratch / "files", "the base model")
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
    specs: Sequence[TaskSpec], tokenizer: Any, tuned_dir: Path, cache_dir: Path, builtin: BuiltinSettings
) -> Path | None:
    names = [spec.name for spec in specs if spec.kind == "builtin"]
    if not names:
        return None
    settings = dataclasses.replace(builtin, tokenizer_id=hash_key(_tokenizer_files(tuned_dir)))
    return write_builtin_tasks(names, cache_dir, settings, lambda text: len(tokenizer(text)["input_ids"]))


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """lm-eval seeds Python's, numpy's and torch's generators (the base's rebuild torch's): put back after."""
    python, numpy_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy_state)


def _lm_eval_log(path: Path) -> contextlib.AbstractContextManager[None]:
    """What lm-eval says (its logger, and what it prints: library_stdout) also goes to `path`."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return _handled(handler, LIBRARY_LOGGER, FILE_LOGGER, "lm_eval")


@contextlib.contextmanager
def _handled(handler: logging.Handler, *names: str) -> Iterator[None]:
    """`handler` on the loggers `names` (at INFO at least) inside the block, then closed."""
    loggers = [logging.getLogger(name) for name in names]
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
    harness: HarnessConfig,
    sampling: EvalConfig | None,
    template: str | None,
    device: str,
    keys: dict[str, str] | None = None,
) -> HarnessSettings:
    """eval.harness for an export in `template` on `device`, sampling as the run's generations; `keys` for refusals."""
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
        keys=dict(keys or {}),
    )


def builtin_of(data: DataConfig, harness: HarnessConfig) -> BuiltinSettings:
    return BuiltinSettings(data.synthetic, harness.lengths(data.max_seq_len))


def _tokenizer_files(model_dir: Path) -> dict[str, Any]:
    return {name: path_fingerprint(model_dir / name) for name in TOKENIZER_FILES if (model_dir / name).is_file()}


def base_identity(model: ModelConfig, seed: int, tuned_dir: Path) -> dict[str, Any]:
    """What the base model's scores depend on: how it is built, the tuned export's tokenizer and dtype."""
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


@contextlib.contextmanager
def base_model_dir(cfg: Config, tuned_dir: Path, scratch: Path) -> Iterator[Path]:
    """The base model's directory: the checkpoint itself, or an export of the rebuilt model under `scratch`."""
    meta = read_metadata(tuned_dir)
    path = cfg.model.name_or_path
    if path is not None and Path(path).expanduser().is_dir():  # the checkpoint itself, when the export kept its
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)  # vocabulary, dtype
        rows = int(getattr(config.get_text_config(), "vocab_size", 0) or 0)
        if meta.get("vocab_size") == rows and meta.get("dtype") == checkpoint_dtype(cfg.model):
            yield Path(path).expanduser()
            return
    generation = meta.get("generation") or {}
    rebuilt = rebuild_config(cfg, base=True)
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
    """The base model's scores under <data.cache_dir>/harness-base/<model>-<key>/, each entry checked, not trusted."""

    def __init__(self, cache_dir: Path, identity: dict[str, Any], settings: dict[str, Any]) -> None:
        self.root = cache_dir / CACHE
        try:
            private_dir(self.root, root=cache_dir)
        except UnsafePath as err:
            raise ConfigError(f"data.cache_dir={err}") from None  # the message starts with the path
        self.model_key = hash_key(identity)
        self.settings = settings

    def entry(self, fingerprint: str) -> Path:
        return self.root / f"{self.model_key}-{hash_key([fingerprint, self.settings])}"

    def read(self, fingerprint: str) -> dict[str, Any] | None:
        shape = {"values": dict, "stderr": dict, "questions": dict}
        return cache_entry(self.entry(fingerprint) / SCORES, shape, valid=TaskScores.valid)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One process scores a base model at a time (the jobs of a sweep started together wait, then read)."""
        with file_lock(self.root / f"{self.model_key}.lock"):
            yield

    def scratch(self) -> Path:
        path = self.root / f".{self.model_key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path

    def store(self, fingerprint: str, files: Path, scores: dict[str, Any]) -> None:
        """`files` (lm-eval's, for this TASK) and `scores` become the entry, renamed into place."""
        (files / SCORES).write_text(json_text(scores, indent=2, sort_keys=True) + "\n")
        target = self.entry(fingerprint)
        if target.exists() or target.is_symlink():  # an entry that was a miss: ds_exp's own directory, replaced
            try:
                check_own(target, directory=True)
            except UnsafePath as err:
                raise ConfigError(f"data.cache_dir={err}") from None
            shutil.rmtree(target)
        files.rename(target)


def run(plan: Plan) -> int:
    """Score what `plan` says (a checkpoint exported first) and print the table."""
    handler = logging.StreamHandler(sys.stderr)  # the evaluation's lines and ds_exp's warnings; the rest in lm_eval.log
    handler.setFormatter(ConsoleFormatter())
    handler.addFilter(lambda record: record.levelno >= logging.WARNING or record.name == __name__)
    with _handled(handler, "ds_exp"):
        hf_logging.disable_progress_bar()
        if plan.checkpoint is not None:
            assert plan.cfg is not None  # a checkpoint's run config rebuilds its model
            print(f"ds_exp: exporting {plan.checkpoint} to {plan.model_dir} first", file=sys.stderr)
            run_dir = run_dir_of(plan.checkpoint)
            export_checkpoint(plan.checkpoint, run_dir, plan.cfg, plan.model_dir, adapter=False, dtype=None)
        device = plan.harness.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        sampling = plan.cfg.eval if plan.cfg else None
        keys = {**CLI_KEYS, "output": "--output", "device": "--device"}
        settings = settings_of(plan.harness, sampling, template_of(plan.model_dir), device, keys)
        data = plan.cfg.data if plan.cfg is not None else DataConfig(name="synthetic")  # the embedded task's defaults
        what = f"{plan.model_dir} and its base model" if plan.base else str(plan.model_dir)
        asked = f"prompts in the {settings.template} template" if settings.applied else "lm-eval's own prompts"
        tasks = ", ".join(s.given for s in plan.specs)
        print(redact_text(f"ds_exp: scoring {what} on {tasks} ({asked}, {device})"), file=sys.stderr)
        evaluation = evaluate(
            plan.model_dir,
            plan.specs,
            settings,
            out_dir=plan.out_dir,
            cache_dir=data_cache_dir(data.cache_dir),
            builtin=builtin_of(data, plan.harness),
            base_cfg=plan.cfg if plan.base else None,
            title=str(plan.model_dir),
        )
        print(redact_text(table(evaluation.record)))
        for line in few_questions(evaluation.record, "--limit"):
            print(redact_text(f"ds_exp: warning: {line}"), file=sys.stderr)
        cached = " (the base model's scores from the cache)" if plan.base and not evaluation.base_scored else ""
        print(f"ds_exp: scores in {plan.out_dir / HARNESS_JSON}{cached}, chart harness.png, lm-eval's samples beside")
        return 0


def template_of(model_dir: Path) -> str | None:
    """The run's template (its export says it), else the tokenizer's chat template, else lm-eval's own prompts."""
    recorded = (read_metadata(model_dir).get("generation") or {}).get("template")
    if recorded is not None:
        return str(recorded)
    return "chat_template" if has_chat_template(AutoTokenizer.from_pretrained(str(model_dir))) else None
