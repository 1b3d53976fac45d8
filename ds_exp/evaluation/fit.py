"""Can the model be judged on the task? One light checker before any weight loads, for validation, the command and the
scoring. Lengths are lower bounds, so a refusal is certain; prompts a task's code makes are measured in scoring."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2.meta
from tokenizers import Tokenizer

from ds_exp.config.paths import embedded_tokenizer_dir
from ds_exp.config.schema import ModelConfig
from ds_exp.core.errors import ConfigError, RunFailed, first_line
from ds_exp.core.files import read_json_object
from ds_exp.launch.storage import check_free_space

Count = Callable[[list[str]], list[int]]  # tokens of each text
DEFAULT_POSITIONS = 2048  # lm-eval's HFLM when neither the config nor the tokenizer says
GENERATED = 256  # HFLM's max_gen_toks when a task's generation_kwargs give none
LENGTH_SAMPLE = 200  # few-shot examples measured for the shortest one
FEW_QUESTIONS = 20  # a score resting on fewer is said to be noise
ROOM = 1 << 20  # harness.json, its chart, lm-eval's log and results: room kept beside the samples
# the command's names for what a run calls eval.harness.<name>
CLI_KEYS = {"tasks": "TASK", "limit": "--limit", "num_fewshot": "--num-fewshot", "passkey_lengths": "--passkey-lengths"}


@dataclass(frozen=True)
class ModelFit:
    """What the tasks are checked against: the model's positions (lm-eval's max_length) and its tokenizer."""

    shown: str  # names the model in a refusal
    positions: int
    count: Count | None = None  # None: lengths are not measured (no tokenizer.json to read lightly)


@dataclass(frozen=True)
class Asked:
    """How the tasks are asked (eval.harness's or the command's) and the keys that say so in a refusal."""

    limit: float | None = None
    num_fewshot: int | None = None
    keys: dict[str, str] = field(default_factory=dict)  # limit, num_fewshot, passkey_lengths -> the key to name

    def key(self, name: str) -> str:
        return self.keys.get(name, f"eval.harness.{name}")


def check_room(directory: Path, key: str, needed: int) -> None:
    """Room on the disk under `directory` for what lm-eval will write there (about `needed` bytes)."""
    try:
        check_free_space({directory: needed + ROOM}, {directory: key})
    except RunFailed as err:
        raise ConfigError(str(err)) from None


def positions_of(config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None) -> int:
    """lm-eval's max_length for a model (lm_eval.models.utils.resolve_max_length, from the JSON files)."""
    text = config.get("text_config")
    chosen = text if isinstance(text, dict) else config
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        if isinstance(chosen.get(key), int):
            return int(chosen[key])
    given = (tokenizer_config or {}).get("model_max_length")
    return int(given) if isinstance(given, int) and given < 10**15 else DEFAULT_POSITIONS


def light_count(tokenizer_dir: Path) -> Count | None:
    """Token counts by the tokenizer's tokenizer.json (the `tokenizers` library: no torch, no transformers)."""
    if not (tokenizer_dir / "tokenizer.json").is_file():
        return None
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    except Exception:  # a tokenizer the library cannot read here: the scoring measures with transformers
        return None
    return lambda texts: [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def model_dir_fit(directory: Path) -> ModelFit:
    """A model directory (an export, any Hugging Face model), from its JSON files."""
    config = read_json_object(directory / "config.json") or {}
    positions = positions_of(config, read_json_object(directory / "tokenizer_config.json"))
    return ModelFit(str(directory), positions, light_count(directory))


def run_model_fit(model: ModelConfig) -> ModelFit | None:
    """The run's model (model.arch or its checkpoint's config.json) and tokenizer; None when not on this machine."""
    local = Path(model.name_or_path).expanduser() if model.name_or_path else None
    config = dict(model.arch or {}) if local is None else read_json_object(local / "config.json") or {}
    if not config:
        return None
    positions = positions_of(config)  # model.rope_scaling leaves them: lm-eval cuts prompts at them all the same
    tokenizer = Path(model.tokenizer).expanduser() if model.tokenizer else local or embedded_tokenizer_dir()
    shown = f"model {model.name}" + (f" ({model.name_or_path})" if model.name_or_path else "")
    return ModelFit(shown, positions, light_count(tokenizer))


def questions_of(limit: float | None, total: int) -> int:
    """How many of `total` questions lm-eval scores under --limit (lm_eval.evaluator's get_sample_size)."""
    if limit is None:
        return total
    return min(total, math.ceil(total * limit) if limit < 1 else int(limit))


def passkey_problems(lengths: Sequence[int], model: ModelFit, asked: Asked) -> list[str]:
    """ds_exp_passkey's prompts (generated at scoring time) within the model's positions."""
    beyond = [n for n in lengths if n > model.positions]
    if not beyond:
        return []
    return [
        f"{asked.key('passkey_lengths')}: ds_exp_passkey's prompts of {beyond[0]} tokens are beyond the "
        f"{model.positions} positions of {model.shown}: lm-eval would cut the passkey's text off and score 0; give "
        f"lengths up to {model.positions}"
    ]


def loaded_problems(
    given: str, loaded: dict[str, Any], model: ModelFit | None, asked: Asked, *, key: str, run_code: bool
) -> tuple[list[str], int]:
    """(problems, bytes of lm-eval's files) of what TaskManager.load made of TASK `given`, against `model`."""
    names = [*(loaded.get("tasks") or {}), *(loaded.get("group_map") or {})]
    found = [
        f"{key}: {given}: its group {group} holds no tasks; name its tasks under `task:`"
        for group, members in (loaded.get("group_map") or {}).items()
        if not members
    ]
    size = 0
    for name, task in (loaded.get("tasks") or {}).items():
        prefix = f"{key}: {given}: " + (f"its task {name}: " if len(names) > 1 or name not in given else "")
        problems, written = _task_problems(task, model, asked, run_code)
        found += [prefix + problem for problem in problems]
        size += written
    return found, size


class _Rows:
    """Where a task's questions come from, for a refusal: its data file and row, or its split and question."""

    def __init__(self, task: Any) -> None:
        config = task.config
        self.split = str(config.test_split or config.validation_split or "test")
        files = (config.dataset_kwargs or {}).get("data_files") if isinstance(config.dataset_kwargs, dict) else None
        files = files.get(self.split) if isinstance(files, dict) else files
        files = files[0] if isinstance(files, list) and len(files) == 1 else files
        self.file = str(files) if isinstance(files, str) and config.process_docs is None else None

    def __call__(self, rows: Sequence[int], total: int) -> str:
        shown = ", ".join(str(i + 1) for i in rows[:5]) + (", ..." if len(rows) > 5 else "")
        many = len(rows) > 1
        where = (
            f"{'rows' if many else 'row'} {shown} of {self.file}"
            if self.file
            else (f"{'questions' if many else 'question'} {shown} of its {self.split} split")
        )
        return where + (f" ({len(rows)} of {total} questions)" if many else "")


def _reads(setting: object, features: Sequence[str]) -> set[str]:
    """The fields of a row a doc_to_* setting reads: the field it names, or its Jinja template's variables."""
    if not isinstance(setting, str):
        return set()
    if setting in features:
        return {setting}
    from lm_eval.utils import env  # lm-eval's Jinja environment: its templates' syntax

    try:
        return set(jinja2.meta.find_undeclared_variables(env.parse(setting)))
    except Exception:  # not a template lm-eval can render: its load says so
        return set()


SETTINGS = ("doc_to_text", "doc_to_target", "doc_to_choice")


def _task_problems(task: Any, model: ModelFit | None, asked: Asked, run_code: bool) -> tuple[list[str], int]:
    """(problems, bytes lm-eval writes) of one leaf task."""
    config, rows = task.config, _Rows(task)
    docs = list(task.eval_docs)
    if not docs:
        return [f"its {rows.split} split holds no questions; give it rows"], 0
    scored = docs[: questions_of(asked.limit, len(docs))]
    features = list(getattr(task, "features", None) or (docs[0].keys() if isinstance(docs[0], dict) else ()))
    found: list[str] = []
    for setting in SETTINGS:
        for name in sorted(_reads(getattr(config, setting, None), features)):
            empty = [i for i, doc in enumerate(scored) if not isinstance(doc, dict) or doc.get(name) is None]
            if empty:
                found.append(
                    f"{rows(empty, len(scored))} {'have' if len(empty) > 1 else 'has'} no field {name}, which its "
                    f"{setting} reads (lm-eval would ask with None in its place): fill it in, or leave those rows out"
                )
    own_shots = task.config.num_fewshot  # lm-eval gives --num_fewshot, unless the task's config fixes 0
    shots = int(asked.num_fewshot) if asked.num_fewshot is not None and own_shots != 0 else int(own_shots or 0)
    pool = len(task.fewshot_docs()) if shots else 0
    own = task.fewshot_cfg.split is not None and task.fewshot_cfg.split == config.test_split
    if shots and pool - own < shots:  # lm-eval's sampler: "Sample larger than population"
        said = asked.key("num_fewshot") + f"={shots}" if asked.num_fewshot is not None else f"num_fewshot: {shots}"
        split = task.fewshot_cfg.split or config.training_split or config.validation_split or config.test_split
        found.append(
            f"{said} few-shot examples, but the task has {max(pool - own, 0)} to draw them from "
            f"({'the other questions of ' if own else ''}its {split} split): give at most {max(pool - own, 0)}"
        )
    measured = _render(task, scored, rows, run_code)
    if isinstance(measured, str):
        return [*found, measured], 0
    texts, answers = measured or ([json.dumps(doc, default=str) for doc in scored], [[] for _ in scored])
    size = sum(
        len(json.dumps(doc, default=str)) + (shots + 1) * len(t) * max(len(a), 1) + 400
        for doc, t, a in zip(scored, texts, answers, strict=True)
    )
    if model is not None and model.count is not None and not found:
        found += _length_problems(task, texts, answers, shots, model, rows)
    return found, size


def _render(task: Any, docs: list[Any], rows: _Rows, run_code: bool) -> tuple[list[str], list[list[str]]] | str | None:
    """(each question's text, its answers) as lm-eval renders them, a problem naming the row, or None (task code)."""
    config = task.config
    if not run_code and any(callable(getattr(config, s, None)) for s in SETTINGS):
        return None
    kind, delimiter = config.output_type, str(config.target_delimiter or "")
    texts, answers = [], []
    for i, doc in enumerate(docs):
        setting = "doc_to_text"
        try:
            text = task.doc_to_text(doc)
            if kind == "multiple_choice":
                setting = "doc_to_choice"
                answers.append([delimiter + str(c) for c in task.doc_to_choice(doc)])
            elif kind == "loglikelihood":
                setting = "doc_to_target"
                answers.append([delimiter + str(task.doc_to_target(doc))])
            else:
                answers.append([])
        except Exception as err:
            return f"{rows([i], len(docs))}: its {setting} fails on it ({type(err).__name__}: {first_line(err)})"
        if not isinstance(text, str):  # a question asked once per choice (winogrande): measured as lm-eval builds it
            return None
        texts.append(text)
    return texts, answers


def _length_problems(
    task: Any, texts: list[str], answers: list[list[str]], shots: int, model: ModelFit, rows: _Rows
) -> list[str]:
    """Questions (with their longest answer, or the tokens to generate) beyond the model's positions."""
    assert model.count is not None
    kind, positions = task.config.output_type, model.positions
    if kind == "loglikelihood_rolling":  # scored in windows of the model's length
        return []
    asked = model.count(texts)
    flat = [a for choices in answers for a in choices]
    counted = iter(model.count(flat)) if flat else iter(())
    longest = [max((next(counted) for _ in choices), default=0) for choices in answers]
    example = 0
    if shots:
        try:  # the shortest few-shot example's question and target (an index of a choice: a lower bound still)
            pool = list(task.fewshot_docs())[:LENGTH_SAMPLE]
            example = min(model.count([task.doc_to_text(d) + str(task.doc_to_target(d)) for d in pool]), default=0)
        except Exception:
            example = 0
    generated = 0
    if kind == "generate_until":
        generated = int((task.config.generation_kwargs or {}).get("max_gen_toks", GENERATED))
    if max(longest, default=0) > positions:
        at = max(range(len(longest)), key=lambda i: longest[i])
        return [
            f"{rows([at], len(texts))}: an answer of {longest[at]} tokens is longer than the {positions} positions "
            f"of {model.shown}: lm-eval cannot score it; shorten it, or score a model with more positions"
        ]
    need = [a + shots * example + max(n, generated) for a, n in zip(asked, longest, strict=True)]
    room = positions if generated else positions + 1  # lm-eval scores an answer's last token without its position
    beyond = [i for i, n in enumerate(need) if n > room]
    if not beyond:
        return []
    what = "and the tokens it generates" if generated else "with its longest answer"
    shot = f", {shots} few-shot examples counted at their shortest" if shots else ""
    return [
        f"{rows(beyond, len(texts))}: {need[beyond[0]]} tokens {what}{shot}, beyond the {positions} positions of "
        f"{model.shown}: lm-eval would cut the beginning of the question off and score what was not asked; "
        "shorten those questions or leave them out, or score a model with more positions"
    ]
