"""Row layouts (prompt/chosen, messages, ShareGPT, Alpaca) -> lists of (role, content) turns, role system | user |
assistant. A bad chat row stops the run naming the file and row; rows without an answer are dropped and counted."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Sequence
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

    def take(self, indices: Collection[int]) -> Rows:
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
    other_layout: int = 0  # rows of another layout, skipped because the source's layout was chosen


def is_marked(roles: Sequence[str], contents: Sequence[str]) -> bool:
    """True when a user turn is DeepSpeed-Chat text with its markers (" Human: ... Assistant:")."""
    return any(
        r == "user" and _MARK_OPEN.match(c) is not None and _MARK_CLOSE.search(c) is not None
        for r, c in zip(roles, contents, strict=True)
    )


def detect_layout(columns: Sequence[str], prompt_field: str, chosen_field: str) -> str:
    """auto's layout: renamed prompt/answer columns first, then messages, sharegpt, alpaca, else prompt/chosen."""
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


def text_value(value: object, key: str, column_key: str, label: str) -> str | None:
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


def _first(turn: dict[str, Any], names: tuple[str, str]) -> object:
    # Arrow structs of mixed files hold both spellings, one of them None
    value = turn.get(names[0])
    return turn.get(names[1]) if value is None else value


def chat_turns(value: object, key: str, where: str, column: str) -> tuple[list[str], list[str]]:
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
    # the user chose the layout (not auto): rows of another layout in the same file are skipped (and counted)
    # instead of refused as a mix
    chosen_by_user: bool = False


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
    skip = _rows_of_other_layouts(columns, get, where, fields, layout, key, label)
    out.other_layout = len(skip)
    if layout == "prompt_chosen" and _holds_turns(columns, get, chosen_field):
        return _conversational_pairs(columns, get, where, fields, key, skip, out), layout
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
            if i in skip:
                continue
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
            if i in skip:
                continue
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
        if i in skip:
            continue
        turns = alpaca_turns(*row, key, where(i))
        if turns is None:
            out.dropped += 1
            continue
        _keep(out, *turns, None, where, i)
    return out, layout


def _holds_turns(columns: Sequence[str], get: Callable[[str], list[Any]], column: str) -> bool:
    """Whether a chosen column holds message lists (Hugging Face's conversational preference rows), not text."""
    if column not in columns:
        return False
    return any(isinstance(v, (list, tuple)) for v in get(column) if v is not None)


def _conversational_pairs(
    columns: Sequence[str],
    get: Callable[[str], list[Any]],
    where: Callable[[int], str],
    fields: Fields,
    key: str,
    skip: Collection[int],
    out: Parsed,
) -> Parsed:
    """TRL's conversational pairs: chosen/rejected message lists, the prompt its own column or their common turns."""
    chosens = get(fields.chosen)
    prompts = get(fields.prompt) if fields.prompt in columns else [None] * len(chosens)
    rejecteds = get(fields.rejected) if fields.rejected and fields.rejected in columns else [None] * len(chosens)
    for i, (prompt, chosen, rejected) in enumerate(zip(prompts, chosens, rejecteds, strict=True)):
        if i in skip:
            continue
        roles, contents = chat_turns(chosen, key, where(i), fields.chosen)
        if roles[-1] != "assistant":
            raise DataError(
                f"{key}: {where(i)}: {fields.chosen!r} does not end on the answer; end it on an assistant turn"
            )
        answer: str | None = None
        if rejected is not None:
            rejected_roles, rejected_contents = chat_turns(rejected, key, where(i), str(fields.rejected))
            shared = len(roles) - 1
            if prompt is None and (rejected_roles[:-1], rejected_contents[:-1]) != (roles[:shared], contents[:shared]):
                raise DataError(
                    f"{key}: {where(i)}: {fields.chosen!r} and {fields.rejected!r} differ before their answers; "
                    f"give both the same turns before the answer, or the turns before it as {fields.prompt!r}"
                )
            answer = rejected_contents[-1]
        if prompt is not None:
            if isinstance(prompt, str):
                prompt_roles, prompt_contents = ["user"], [prompt]
            else:  # messages before the answer: the same checks as a conversation's, bar "no assistant turn"
                prompt_roles, prompt_contents = chat_turns(
                    [*prompt, {"role": "assistant", "content": ""}], key, where(i), fields.prompt
                )
                prompt_roles, prompt_contents = prompt_roles[:-1], prompt_contents[:-1]
            roles, contents = [*prompt_roles, *roles[-1:]], [*prompt_contents, *contents[-1:]]
        if not contents[-1].strip() or "user" not in roles:
            out.dropped += 1  # a blank answer or no prompt: as a prompt/chosen row without them
            continue
        _keep(out, roles, contents, answer, where, i)
    return out


_WHERE = re.compile(r"^(?P<file>.*?)(?::(?P<line>\d+)|: (?P<kind>item|row) (?P<num>\d+))$")


def _families(fields: Fields) -> dict[str, tuple[str, ...]]:
    """The columns that make each layout, in detect_layout's order of precedence."""
    pair = (fields.prompt, fields.chosen)
    renamed = pair != ("prompt", "chosen")
    families = {"messages": (MESSAGES_COLUMN,), "sharegpt": (SHAREGPT_COLUMN,), "alpaca": ("instruction", "output")}
    return {"prompt_chosen": pair, **families} if renamed else {**families, "prompt_chosen": pair}


def row_layouts(
    columns: Sequence[str], get: Callable[[str], list[Any]], fields: Fields
) -> list[tuple[str, ...]] | None:
    """The layouts each row fills, in detect_layout's order; None when the columns belong to one layout only."""
    families = {name: [c for c in cols if c in columns] for name, cols in _families(fields).items()}
    families = {name: cols for name, cols in families.items() if cols}
    if len(families) < 2:
        return None
    values = {c: get(c) for cols in families.values() for c in cols}
    n = len(next(iter(values.values())))

    def filled(column: str, i: int) -> bool:
        value = values[column][i]
        return value is not None and not (isinstance(value, float) and math.isnan(value))

    return [tuple(name for name, cols in families.items() if any(filled(c, i) for c in cols)) for i in range(n)]


def _rows_of_other_layouts(
    columns: Sequence[str],
    get: Callable[[str], list[Any]],
    where: Callable[[int], str],
    fields: Fields,
    layout: str,
    key: str,
    label: str,
) -> set[int]:
    """Rows in another layout than the one read: skipped if the user chose it, else one message saying how to choose."""
    layouts = row_layouts(columns, get, fields)
    if layouts is None:
        return set()
    others = {i for i, fills in enumerate(layouts) if fills and layout not in fills}
    if not others or fields.chosen_by_user:
        return others
    groups: dict[str, list[int]] = {}
    for i, fills in enumerate(layouts):
        if fills:
            groups.setdefault(layout if layout in fills else fills[0], []).append(i)
    ordered = sorted(groups.items(), key=lambda item: -len(item[1]))
    said = "; ".join(
        f"{name} at {_spans(where, rows)} ({len(rows)} row{'s' if len(rows) > 1 else ''})" for name, rows in ordered
    )
    if len(groups) == 1:  # an eval split in another layout than its source's train split
        said += f"; the source's train rows are {layout}"
    hint = key.replace("[", ".").replace("]", "")
    most = ordered[0][0]
    alternatives = ", ".join(name for name in groups if name != most) or layout
    raise DataError(
        f"{key}: {label} mixes row layouts: {said}. One source reads one layout: set {hint}.layout={most} (or "
        f"{alternatives}) to train on those rows only, skipping the others, or split the file into one source per "
        "layout"
    )


def _spans(where: Callable[[int], str], rows: list[int], most: int = 4) -> str:
    """Rows as ranges of the numbers their files use: "lines 1-5, 11-15", "items 0-3", or their places."""
    matches = [_WHERE.match(where(i)) for i in rows]
    if not all(matches):
        return ", ".join(where(i) for i in rows[:3]) + (", ..." if len(rows) > 3 else "")
    first = matches[0]
    assert first is not None
    kind = ("line" if first["line"] else first["kind"]) + ("s" if len(rows) > 1 else "")
    numbers = [int(m["line"] or m["num"]) for m in matches if m is not None]
    ranges: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return f"{kind} {', '.join(ranges[:most])}{', ...' if len(ranges) > most else ''}"


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
