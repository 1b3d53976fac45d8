"""Row layouts -> conversations: prompt/chosen, Hugging Face messages, ShareGPT and Alpaca rows all become a
list of (role, content) turns with role system | user | assistant. Pure standard library.

Bad chat rows (unknown role, empty conversation, no assistant turn, content not a string) stop the run with
one message naming the file and the row; rows without an answer are dropped and counted, as for prompt/chosen.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ds_exp.core.errors import DataError

LAYOUTS = ("auto", "prompt_chosen", "messages", "sharegpt", "alpaca")
MESSAGES_COLUMN = "messages"  # Hugging Face chat: [{"role", "content"}, ...]
SHAREGPT_COLUMN = "conversations"  # ShareGPT: [{"from", "value"}, ...]
ALPACA_COLUMNS = ("instruction", "input", "output")
CHAT_COLUMNS = (MESSAGES_COLUMN, SHAREGPT_COLUMN)
PAIR = ["user", "assistant"]  # the roles of every prompt/chosen row: one shared list (never mutated)
# Role names of both chat layouts (lower-cased) -> ours. ShareGPT dumps name the assistant after the model.
ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}
# DeepSpeed-Chat's rows carry their markers in the prompt: " Human: ... Assistant:" (Dahoas/rm-static uses
# "\n\nHuman: ... \n\nAssistant:"). A user turn is marked when it opens with Human: and ends with Assistant:.
_MARK_OPEN = re.compile(r"\s*Human:")
_MARK_CLOSE = re.compile(r"(?:^|\s)Assistant:\s*$")


@dataclass
class Rows:
    """One split of one source, already filtered: every row is a conversation with an answer to train on."""

    roles: list[list[str]] = field(default_factory=list)  # per row: system | user | assistant per turn
    contents: list[list[str]] = field(default_factory=list)
    rejected: list[str | None] = field(default_factory=list)  # DeepSpeed-Chat's column; carried, unused by SFT
    template: list[str] = field(default_factory=list)  # resolved per source by the pipeline ("" until then)

    def __len__(self) -> int:
        return len(self.roles)

    def add(self, roles: list[str], contents: list[str], rejected: str | None = None) -> None:
        self.roles.append(roles)
        self.contents.append(contents)
        self.rejected.append(rejected)
        self.template.append("")

    def set_template(self, template: str) -> None:
        self.template = [template] * len(self)

    def take(self, indices: Any) -> Rows:
        return Rows(
            [self.roles[i] for i in indices],
            [self.contents[i] for i in indices],
            [self.rejected[i] for i in indices],
            [self.template[i] for i in indices],
        )

    def extend(self, other: Rows) -> None:
        self.roles += other.roles
        self.contents += other.contents
        self.rejected += other.rejected
        self.template += other.template


@dataclass
class Parsed:
    rows: Rows
    dropped: int = 0  # rows without a prompt or with a blank answer
    marked: int = 0  # rows whose user turn already carries DeepSpeed-Chat's markers
    first_marked: str | None = None  # where the first of them is, for messages
    where: list[str] | None = None  # where each kept row is (only when asked: finding a row for an error)


def is_marked(roles: Sequence[str], contents: Sequence[str]) -> bool:
    """True when a user turn is DeepSpeed-Chat text with its markers (" Human: ... Assistant:")."""
    return any(
        r == "user" and _MARK_OPEN.match(c) is not None and _MARK_CLOSE.search(c) is not None
        for r, c in zip(roles, contents, strict=True)
    )


def detect_layout(columns: Sequence[str], prompt_field: str, chosen_field: str) -> str:
    """auto: messages -> messages, conversations -> sharegpt, instruction + output -> alpaca, else prompt/chosen.

    Prompt/answer columns that were renamed from the defaults (and exist) win: the user asked for them.
    """
    renamed = (prompt_field, chosen_field) != ("prompt", "chosen")
    if renamed and prompt_field in columns and chosen_field in columns:
        return "prompt_chosen"
    if MESSAGES_COLUMN in columns:
        return "messages"
    if SHAREGPT_COLUMN in columns:
        return "sharegpt"
    if "instruction" in columns and "output" in columns:
        return "alpaca"
    return "prompt_chosen"


# ----------------------------------------------------------------------------------------------- parsing


def text_value(value: Any, key: str, column_key: str, label: str) -> str | None:
    """A prompt/chosen cell as text; None = missing. Numbers become text, anything else is a column error."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and math.isnan(value):  # pandas-style missing value
        return None
    if isinstance(value, (int, float, bool)):
        return str(value)
    raise DataError(
        f"{key}.{column_key}: {label} holds {type(value).__name__} values in that column, not text; "
        "point the field at a text column"
    )


def _first(turn: dict[str, Any], names: tuple[str, str]) -> Any:
    # Arrow structs of mixed files hold both spellings, one of them None
    value = turn.get(names[0])
    return turn.get(names[1]) if value is None else value


def chat_turns(value: Any, key: str, where: str, column: str) -> tuple[list[str], list[str]]:
    """A messages / conversations cell -> (roles, contents); a bad row is a DataError naming it."""

    def bad(problem: str, fix: str) -> DataError:
        return DataError(f"{key}: {where}: {problem}; {fix}")

    if value is None or (isinstance(value, (list, tuple)) and not value):
        raise bad(f"empty conversation ({column!r} is {'missing' if value is None else 'empty'})", "remove the row")
    if not isinstance(value, (list, tuple)):
        raise bad(f"{column!r} is a {type(value).__name__}, not a list of turns", "give a list of turn objects")
    roles: list[str] = []
    contents: list[str] = []
    for j, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise bad(f"turn {j} is a {type(turn).__name__}, not an object", 'write turns as {"role", "content"}')
        role, content = _first(turn, ("role", "from")), _first(turn, ("content", "value"))
        mapped = ROLES.get(role.lower()) if isinstance(role, str) else None
        if mapped is None:
            known = "system, user (human), assistant (gpt)"
            raise bad(f"turn {j} has unknown role {role!r}", f"use one of {known}")
        if not isinstance(content, str):
            raise bad(f"turn {j} ({role}) content is {type(content).__name__}, not a string", "give its text")
        roles.append(mapped)
        contents.append(content)
    if "assistant" not in roles:
        raise bad("no assistant turn, so nothing to train on", "add the answer as an assistant turn or remove the row")
    return roles, contents


def alpaca_turns(instruction: Any, given: Any, output: Any, key: str, where: str) -> tuple[list[str], list[str]] | None:
    """[(user, instruction + "\\n\\n" + input), (assistant, output)]; None when the row has nothing to train on."""
    for name, value in zip(ALPACA_COLUMNS, (instruction, given, output), strict=True):
        if value is not None and not isinstance(value, str):
            raise DataError(f"{key}: {where}: {name!r} is {type(value).__name__}, not a string; give its text")
    if instruction is None or output is None or not output.strip():
        return None
    prompt = instruction + (f"\n\n{given}" if given and given.strip() else "")
    return ["user", "assistant"], [prompt, output]


@dataclass
class Fields:
    """What a source says about its row layout (DataSource.layout, prompt_field, chosen_field, rejected_field)."""

    layout: str = "auto"
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str | None = "rejected"


def parse_rows(
    columns: list[str],
    get: Callable[[str], list[Any]],
    where: Callable[[int], str],
    fields: Fields,
    key: str,
    label: str,
    *,
    locate: bool = False,
) -> tuple[Parsed, str]:
    """All rows of one table as conversations, and the layout used. where(i) names row i for messages."""
    prompt_field, chosen_field, layout = fields.prompt, fields.chosen, fields.layout
    if layout == "auto":
        layout = detect_layout(columns, prompt_field, chosen_field)
    out = Parsed(Rows(), where=[] if locate else None)
    if layout == "prompt_chosen":
        names = {"prompt": prompt_field, "chosen": chosen_field}
        for role, column in names.items():
            if column not in columns:
                shown = ", ".join(columns) if columns else "none (empty file?)"
                raise DataError(
                    f"{key}.{role}_field={column}: column not found in {label}; its columns are: {shown} "
                    f"(chat rows: set {key}.layout=messages, sharegpt or alpaca)"
                )
        prompts = [text_value(v, key, "prompt_field", label) for v in get(prompt_field)]
        chosens = [text_value(v, key, "chosen_field", label) for v in get(chosen_field)]
        rejected_col = fields.rejected
        if rejected_col and rejected_col in columns:
            rejecteds = [text_value(v, key, "rejected_field", label) for v in get(rejected_col)]
        else:
            rejecteds = [None] * len(prompts)
        for i, (p, c, r) in enumerate(zip(prompts, chosens, rejecteds, strict=True)):
            if p is None or c is None or not c.strip():
                out.dropped += 1
                continue
            _keep(out, PAIR, [p, c], r, where, i)
        return out, layout
    if layout in ("messages", "sharegpt"):
        column = MESSAGES_COLUMN if layout == "messages" else SHAREGPT_COLUMN
        if column not in columns:
            raise DataError(
                f"{key}.layout={layout}: {label} has no {column!r} column; its columns are: {', '.join(columns)}"
            )
        for i, value in enumerate(get(column)):
            roles, contents = chat_turns(value, key, where(i), column)
            if not any(c.strip() for r, c in zip(roles, contents, strict=True) if r == "assistant"):
                out.dropped += 1  # every answer blank: like a blank chosen
                continue
            _keep(out, roles, contents, None, where, i)
        return out, layout
    missing = [c for c in ("instruction", "output") if c not in columns]
    if missing:
        raise DataError(
            f"{key}.layout=alpaca: {label} has no {', '.join(map(repr, missing))} column; "
            f"its columns are: {', '.join(columns)}"
        )
    instructions = get("instruction")
    given = get("input") if "input" in columns else [None] * len(instructions)
    for i, row in enumerate(zip(instructions, given, get("output"), strict=True)):
        turns = alpaca_turns(*row, key, where(i))
        if turns is None:
            out.dropped += 1
            continue
        _keep(out, *turns, None, where, i)
    return out, layout


def _keep(
    out: Parsed, roles: list[str], contents: list[str], rejected: str | None, where: Callable[[int], str], i: int
) -> None:
    if roles[-1] != "assistant":
        # turns after the last answer carry no label: dropped so every template ends on the answer
        last = max(j for j, r in enumerate(roles) if r == "assistant")
        roles, contents = roles[: last + 1], contents[: last + 1]
    out.rows.add(roles, contents, rejected)
    if out.where is not None:
        out.where.append(where(i))
    if is_marked(roles, contents):
        out.marked += 1
        if out.first_marked is None:
            out.first_marked = where(i)
