"""The embedded SFT task, generated from a seed so the default run needs no download: copying, reversing, key-value
lookup and sorting digits, mixed evenly, each answer a pure function of its prompt and learnable by a 2-layer model."""

from __future__ import annotations

import random
from collections.abc import Iterator

# Short English words that the embedded byte-level BPE learns as single tokens.
# fmt: off
NOUNS = (
    "apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum",
    "cat", "dog", "fox", "owl", "bee", "ant", "cow", "pig",
)
# fmt: on
COLORS = ("red", "blue", "green", "gold", "pink", "gray", "black", "white")
WORDS = NOUNS + COLORS
TASKS = ("reverse", "repeat", "sort", "lookup")


def make_example(rng: random.Random) -> dict[str, str]:
    """One prompt/chosen pair; the task is drawn uniformly."""
    task = rng.choice(TASKS)
    if task in ("reverse", "repeat"):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 6))]
        answer = reversed(words) if task == "reverse" else words
        return {"prompt": f"{task} the words: " + " ".join(words), "chosen": " ".join(answer)}
    if task == "sort":
        digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
        return {
            "prompt": "sort the digits: " + " ".join(map(str, digits)),
            "chosen": " ".join(map(str, sorted(digits))),
        }
    # lookup: 2-4 distinct animals each given a color in context, then one is asked for
    keys = rng.sample(NOUNS[8:], rng.randint(2, 4))
    facts = {key: rng.choice(COLORS) for key in keys}
    asked = rng.choice(keys)
    context = ", ".join(f"the {key} is {color}" for key, color in facts.items())
    return {"prompt": f"{context}. what color is the {asked}?", "chosen": facts[asked]}


def generate(num_train: int, num_eval: int, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, eval) rows from separate random streams; eval prompts also in train are skipped."""
    train_rng = random.Random(f"ds_exp-synthetic-train-{seed}")  # str seeds are stable across runs
    train = [make_example(train_rng) for _ in range(num_train)]
    seen = {row["prompt"] for row in train}
    eval_rows = list(unseen_examples(random.Random(f"ds_exp-synthetic-eval-{seed}"), seen, num_eval))
    # "rejected" keeps DeepSpeed-Chat's row shape (reward-model phases): the answer, first token wrong
    for row in (*train, *eval_rows):
        row["rejected"] = _wrong(row["chosen"])
    return train, eval_rows


def unseen_examples(rng: random.Random, seen: set[str], count: int) -> Iterator[dict[str, str]]:
    """`count` examples whose prompts are not in `seen` (added to it), drawn as they are consumed."""
    made = attempts = 0
    while made < count:
        row = make_example(rng)
        attempts += 1
        # the lookup/sort spaces are large, so this only loops on absurd sizes; bound it anyway
        if row["prompt"] in seen and attempts < 100 * (count + 1):
            continue
        seen.add(row["prompt"])
        made += 1
        yield row


def _wrong(answer: str) -> str:
    first, *rest = answer.split(" ")
    if first.isdigit():
        first = str((int(first) + 1) % 10)
    else:
        pool = COLORS if first in COLORS else WORDS
        first = pool[(pool.index(first) + 1) % len(pool)]
    return " ".join([first, *rest])


def corpus(num_rows: int = 20000, seed: int = 0) -> list[str]:
    """Texts in DeepSpeed-Chat format that the embedded tokenizer is trained on."""
    train, _ = generate(num_rows, 0, seed)
    return [f" Human: {row['prompt']} Assistant: {row['chosen']}" for row in train]
