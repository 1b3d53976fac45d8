"""ds_exp's offline lm-eval tasks, generated from a seed into the data cache: `ds_exp_synthetic` (multiple choice from
the embedded SFT task, chance 25%) and `ds_exp_passkey_<N>` (a passkey hidden in N tokens of filler)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ds_exp.config.schema import SyntheticDataConfig
from ds_exp.core.files import json_text
from ds_exp.data.cache import cached_build, hash_key
from ds_exp.data.synthetic import COLORS, NOUNS, WORDS, generate, unseen_examples

SYNTHETIC = "ds_exp_synthetic"
PASSKEY = "ds_exp_passkey"
SYNTHETIC_QUESTIONS = 200
PASSKEYS_PER_LENGTH = 20
VERSION = 1  # of the generated files: a change here makes new cache directories
FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)


@dataclass(frozen=True)
class BuiltinSettings:
    """What the built-in tasks are generated from: the run's embedded task (its training prompts are left out)."""

    synthetic: SyntheticDataConfig
    passkey_lengths: tuple[int, ...]
    tokenizer_id: str = ""  # what measures the passkey prompts (its files' fingerprint)

    def material(self, names: Sequence[str]) -> dict[str, Any]:
        return {
            "version": VERSION,
            "tasks": sorted(names),
            "synthetic": [self.synthetic.num_train, self.synthetic.seed] if SYNTHETIC in names else None,
            "passkey": [list(self.passkey_lengths), self.tokenizer_id] if PASSKEY in names else None,
        }


def write_builtin_tasks(
    names: Sequence[str], cache_dir: Path, settings: BuiltinSettings, count_tokens: Callable[[str], int]
) -> Path:
    """The directory holding the YAML files and data of the built-in tasks `names` (built once per settings)."""
    material = settings.material(names)
    key = f"harness-tasks-{hash_key(material)}"
    final = (cache_dir / key).resolve()  # where the data files are once the directory is in place

    def build(tmp: Path) -> dict[str, Any]:
        made: dict[str, Any] = {}
        if SYNTHETIC in names:
            rows = synthetic_questions(SYNTHETIC_QUESTIONS, settings.synthetic)
            made[SYNTHETIC] = _write_task(
                tmp, final, SYNTHETIC, rows, _lm_eval_task(SYNTHETIC, "multiple_choice", "acc", doc_to_choice="choices")
            )
        if PASSKEY in names:
            subtasks = []
            for length in settings.passkey_lengths:
                name = f"{PASSKEY}_{length}"
                rows = passkey_rows(length, PASSKEYS_PER_LENGTH, settings.synthetic.seed, count_tokens)
                made[name] = _write_task(tmp, final, name, rows, passkey_task(name))
                subtasks.append(name)
            group = {
                "group": PASSKEY,
                "task": subtasks,
                "aggregate_metric_list": [{"metric": "exact_match", "aggregation": "mean", "weight_by_size": True}],
                "metadata": {"version": VERSION},
            }
            (tmp / f"{PASSKEY}.yaml").write_text(yaml.safe_dump(group, sort_keys=False))
        return made

    _, _, _, path = cached_build(cache_dir, key, build, lambda directory: directory, material)
    return path


def _write_task(directory: Path, final: Path, name: str, rows: list[dict[str, Any]], task: dict[str, Any]) -> int:
    (directory / f"{name}.jsonl").write_text("".join(json_text(row) + "\n" for row in rows))
    task = {**task, "dataset_kwargs": {"data_files": {"test": str(final / f"{name}.jsonl")}}}
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
    return len(rows)


def _lm_eval_task(name: str, output_type: str, metric: str, **more: Any) -> dict[str, Any]:
    return {
        "task": name,
        "dataset_path": "json",
        "test_split": "test",
        "output_type": output_type,
        "doc_to_text": "question",
        **more,
        "doc_to_target": "answer",
        "metric_list": [{"metric": metric, "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": VERSION},
    }


def passkey_task(name: str) -> dict[str, Any]:
    return _lm_eval_task(
        name,
        "generate_until",
        "exact_match",
        generation_kwargs={"until": ["\n"], "do_sample": False, "max_gen_toks": 16},
        # the first number of the answer ("The pass key is 48213." counts as 48213)
        filter_list=[
            {"name": "number", "filter": [{"function": "regex", "regex_pattern": r"(\d+)"}, {"function": "take_first"}]}
        ],
    )


def synthetic_questions(count: int, synthetic: SyntheticDataConfig) -> list[dict[str, Any]]:
    """`count` questions from the embedded task's generator, never trained on: {"question", "choices" (4), "answer"}."""
    train, _ = generate(synthetic.num_train, 0, synthetic.seed)
    seen = {row["prompt"] for row in train}
    rng = random.Random(f"ds_exp-harness-synthetic-{synthetic.seed}")
    rows: list[dict[str, Any]] = []
    for example in unseen_examples(rng, seen, count):
        choices = [example["chosen"], *near_misses(example["prompt"], example["chosen"], rng)]
        order = list(range(len(choices)))
        rng.shuffle(order)
        rows.append({"question": example["prompt"], "choices": [choices[i] for i in order], "answer": order.index(0)})
    return rows


def near_misses(prompt: str, answer: str, rng: random.Random) -> list[str]:
    """Three wrong answers a model that half learned the task would give."""
    head, _, rest = prompt.partition(": ")
    given = rest.split(" ")
    candidates: list[str] = []
    if head in ("reverse the words", "repeat the words"):
        candidates += [" ".join(given) if head == "reverse the words" else " ".join(reversed(given))]
        candidates += [_one_off(answer, WORDS, rng), _one_off(answer, WORDS, rng)]
    elif head == "sort the digits":
        digits = sorted(given)
        candidates += [" ".join(given), " ".join(reversed(digits)), _one_off(answer, tuple("0123456789"), rng)]
    else:  # lookup: the other colours of the context first
        candidates += [color for color in COLORS if f" is {color}" in prompt and color != answer]
    pool = COLORS if answer in COLORS else WORDS if answer.split(" ")[0] in NOUNS + COLORS else tuple("0123456789")
    wrong: list[str] = []
    for candidate in [*candidates, *(_one_off(answer, pool, rng) for _ in range(50))]:
        if candidate != answer and candidate not in wrong:
            wrong.append(candidate)
    return wrong[:3]


def _one_off(answer: str, pool: Sequence[str], rng: random.Random) -> str:
    """The answer with one of its items replaced by another of `pool`."""
    items = answer.split(" ")
    at = rng.randrange(len(items))
    items[at] = rng.choice([p for p in pool if p != items[at]])
    return " ".join(items)


def passkey_rows(length: int, count: int, seed: int, count_tokens: Callable[[str], int]) -> list[dict[str, Any]]:
    """`count` prompts of about `length` tokens (16 left for template and answer), each hiding a five-digit passkey."""
    rng = random.Random(f"ds_exp-harness-passkey-{seed}-{length}")
    rows = []
    for _ in range(count):
        key = str(rng.randint(10000, 99999))
        depth = rng.random()
        fits = 0
        low, high = 0, max(1, length)  # filler sentences: the most that keep the prompt within its budget
        while low <= high:
            middle = (low + high) // 2
            if count_tokens(_passkey_prompt(key, middle, depth)) <= length - 16:
                fits, low = middle, middle + 1
            else:
                high = middle - 1
        rows.append({"question": _passkey_prompt(key, fits, depth), "answer": key})
    return rows


def _passkey_prompt(key: str, sentences: int, depth: float) -> str:
    filler = [FILLER[i % len(FILLER)] for i in range(sentences)]
    at = round(depth * sentences)
    hidden = f"The pass key is {key}. Remember it. {key} is the pass key."
    text = " ".join([*filler[:at], hidden, *filler[at:]])
    return f"There is a pass key hidden in this text. Find it and remember it. {text} What is the pass key?"
