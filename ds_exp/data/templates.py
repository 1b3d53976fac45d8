"""Templates: how a conversation becomes one text, and which characters of it are labels (every assistant content plus
the end token after it). raw: the turn contents as given, then the end-of-conversation token; dschat: " Human: {user}"
and " Assistant: {assistant}" per turn, then that token; chat_template: the tokenizer's, rendered turn by turn; auto:
chat_template when the tokenizer has one, else dschat, raw for rows with the markers. Light."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ds_exp.core.errors import DataError
from ds_exp.data.conversations import is_marked

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ds_exp.config.schema import PromptTemplate
    from ds_exp.data.sources import RawSource

log = logging.getLogger(__name__)

Span = tuple[int, int]  # [start, end) characters of the rendered text that are labels


class RowError(Exception):
    """A row the template cannot render: args = (problem, roles, contents); the pipeline finds the row."""


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_template(template: PromptTemplate | str, tokenizer: PreTrainedTokenizerBase) -> str:
    """The run's template before looking at rows: raw, dschat or chat_template (auto = by the tokenizer)."""
    template = str(getattr(template, "value", template))
    if template == "auto":
        return "chat_template" if has_chat_template(tokenizer) else "dschat"
    if template == "chat_template" and not has_chat_template(tokenizer):
        raise DataError(
            "data.template=chat_template: the tokenizer has no chat template; use dschat or auto, "
            "or a tokenizer that ships one"
        )
    return template


def source_template(configured: PromptTemplate | str, resolved: str, raw: RawSource) -> str:
    """One source's template given its rows: rows with DeepSpeed-Chat's markers get raw (an error if asked to wrap)."""
    configured = str(getattr(configured, "value", configured))
    marked, total = raw.num_marked, raw.num_rows
    if raw.key == "data.synthetic":
        if resolved == "raw":
            log.info("data.synthetic: template raw renders the task as DeepSpeed-Chat's text (dschat)")
            return "dschat"
        return resolved
    if resolved == "raw":
        if not marked:
            log.warning(
                "%s: data.template=raw but no row carries ' Human: ... Assistant:' markers: prompt and answer "
                "are concatenated as given, with no markup between them",
                raw.key,
            )
        return "raw"
    if not marked:
        return resolved
    share = f"{marked} of {total} rows" if marked < total else f"all {total} rows"
    what = f"{share} already carry DeepSpeed-Chat's markers (' Human: ... Assistant:'), first at {raw.first_marked}"
    if configured == "auto" and 2 * marked >= total:
        log.info("%s: %s; data.template=auto uses raw for this source (the text as given)", raw.key, what)
        return "raw"
    if configured == "auto":
        log.warning("%s: %s; data.template=auto wraps them again (%s): clean those rows", raw.key, what, resolved)
        return resolved
    raise DataError(
        f"{raw.key}: {what}; data.template={configured} would wrap them a second time: "
        "set data.template=raw to train on the text as given (or auto, which picks raw for such rows)"
    )


def row_markup(raw: RawSource) -> str | None:
    """The markup most of a raw source's rows carry themselves ("dschat": DeepSpeed-Chat's), else None."""
    return "dschat" if raw.template == "raw" and raw.num_marked and 2 * raw.num_marked >= raw.num_rows else None


def first_template(stats: dict[str, Any]) -> str:
    """How the run asks its model a prompt: its first source's template (dschat for raw rows with the markers)."""
    sources = stats.get("per_source") or [{}]
    return str(sources[0].get("markup") or str(stats["template"]).split("+")[0])


def render_prompt(prompt: str, template: str, tokenizer: PreTrainedTokenizerBase) -> tuple[str, bool]:
    """A user's prompt as the run's template asks the model: (text to complete, whether to add special tokens)."""
    return render_conversation([("user", prompt)], template, tokenizer)


def render_conversation(
    turns: Sequence[tuple[str, str]], template: str, tokenizer: PreTrainedTokenizerBase
) -> tuple[str, bool]:
    """A conversation so far (ending with the user's turn) as the template asks the model for the next answer."""
    if len(turns) == 1:  # a prompt: the user's
        turns = [("user", turns[0][1])]
    if template == "chat_template":
        messages = [{"role": role, "content": content} for role, content in turns]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False  # type: ignore[return-value]  # tokenize=False: a str (hinted as every kind)
    # as render_dschat writes a conversation, the next answer's head last; a prompt that holds DeepSpeed-Chat's
    # markers already goes as given
    if template == "dschat" and not (len(turns) == 1 and is_marked(("user",), (turns[0][1],))):
        heads = {"user": " Human: ", "assistant": " Assistant: ", "system": ""}
        return "".join(heads[role] + content for role, content in turns) + " Assistant:", True
    return "".join(content for _, content in turns), True


def _is_pair(roles: Sequence[str]) -> bool:
    return len(roles) == 2 and roles[0] == "user" and roles[1] == "assistant"


def render_raw(roles: Sequence[str], contents: Sequence[str], eot: str) -> tuple[str, list[Span]]:
    if _is_pair(roles):  # prompt/chosen rows, the common case: no loop
        text = f"{contents[0]}{contents[1]}{eot}"
        return text, [(len(contents[0]), len(text))]
    return _render_pieces([("", c) for c in contents], roles, eot)


def render_dschat(roles: Sequence[str], contents: Sequence[str], eot: str) -> tuple[str, list[Span]]:
    if _is_pair(roles):
        head = f" Human: {contents[0]} Assistant:"
        text = f"{head} {contents[1]}{eot}"
        return text, [(len(head), len(text))]
    heads = {"user": " Human: ", "assistant": " Assistant:", "system": ""}
    pieces = []
    for role, content in zip(roles, contents, strict=True):
        # the answer's label starts at the space after " Assistant:", as DeepSpeed-Chat's text has it
        pieces.append((heads[role], f" {content}" if role == "assistant" else content))
    return _render_pieces(pieces, roles, eot)


def _render_pieces(pieces: list[tuple[str, str]], roles: Sequence[str], eot: str) -> tuple[str, list[Span]]:
    """(head, body) per turn; assistant bodies are labels and the eot after the last one is too."""
    parts: list[str] = []
    spans: list[Span] = []
    pos = 0
    for (head, body), role in zip(pieces, roles, strict=True):
        pos += len(head)
        if role == "assistant":
            spans.append((pos, pos + len(body)))
        parts += (head, body)
        pos += len(body)
    text = "".join(parts) + eot
    spans[-1] = (spans[-1][0], len(text))
    return text, spans


def render_chat(
    tokenizer: PreTrainedTokenizerBase, roles: Sequence[str], contents: Sequence[str], specials: Sequence[str]
) -> tuple[str, list[Span]]:
    """The tokenizer's chat template; assistant turn i spans from turns[:i]'s generation prompt to its end token."""
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]

    def apply(turns: list[dict[str, str]], generation: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation)  # type: ignore[return-value]  # tokenize=False: a str (hinted as every kind)
        except Exception as err:  # jinja's raise_exception (roles must alternate, ...) and template bugs
            problem = f"the tokenizer's chat template rejects this conversation ({type(err).__name__}: {err})"
            raise RowError(problem, list(roles), list(contents)) from None

    full = apply(messages)
    last = len(messages) - 1  # rows end on an assistant turn (conversations._keep)
    spans: list[Span] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = apply(messages[:i], generation=True)
        turn = full if i == last else apply(messages[: i + 1])
        # templates that rewrite earlier turns (rare): the answer starts after the common prefix
        start = len(os.path.commonprefix([head, full]))  # noqa: RUF071  # characters, not paths
        turn_end = len(turn) if full.startswith(turn) else len(full)
        content = message["content"]
        found = full.find(content, start, turn_end) if content else start
        if found < 0 and content.strip():
            content = content.strip()  # templates that trim the answer
            found = full.find(content, start, turn_end)
        if found < 0:
            problem = "the tokenizer's chat template changes the assistant's text, so its tokens cannot be found"
            raise RowError(problem, list(roles), list(contents))
        end = found + len(content)
        tail = full[end:turn_end]
        gap = len(tail) - len(tail.lstrip())
        eot = next((s for s in specials if tail.startswith(s, gap)), None)
        spans.append((found, end + gap + len(eot) if eot else end))
    return full, spans


def special_strings(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The tokenizer's special tokens as text, longest first (end-of-turn candidates for chat templates)."""
    found = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            found.add(str(token.content))
    return tuple(sorted((s for s in found if s), key=lambda s: (-len(s), s)))
