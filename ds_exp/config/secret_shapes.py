"""Which parts of a value are credentials whatever its key is called: what a value's shape gives away.

* a URL's user-info, `scheme://user:PASSWORD@host/...`: the password (the scheme, user and host stay readable);
* fields of a connection string or a URL's query named like credentials (ds_exp/config/secret_names.py), and the
  connection-string keywords that are not English (`Pwd`): `AccountKey=`, `Password=`, `pwd=`,
  `SharedAccessSignature=`, `SharedAccessKey=`, `?sig=`, `&token=`: the field's value;
* webhook URLs, whose path is the credential: `hooks.slack.com/services/T../B../XXXX`, `discord.com/api/webhooks/
  ID/TOKEN`, any `.../webhook(s)/...`: the path after it; and a path segment named like a credential,
  `https://host/token/VALUE`, `https://api.telegram.org/botID:TOKEN/...`: what follows;
* the well-known token formats that say what they are (`ghp_...`, `github_pat_...`, `hf_...`, `sk-...`,
  `xoxb-...`, `AKIA...`): the whole token.

A local path is not a URL: `/data/token/x.jsonl` and `hf_model/` keep their text. Import-light: standard library.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ds_exp.config.secret_names import is_secret_name


class Span(NamedTuple):
    start: int
    end: int
    what: str  # for messages: "a password in a URL", ...


# scheme://[user]:password@host: the password may hold "@" (greedy up to the last one before the host)
# (bounded repeats: a long run of text is scanned in linear time)
_USERINFO = re.compile(
    r"\b[A-Za-z][A-Za-z0-9+.-]{0,30}://[^\s:/?#@'\"]{0,256}:(?P<secret>[^\s/?#'\"]{1,1024})@(?=[^\s@/?#'\"])"
)
# NAME=VALUE in a connection string (`;`), a query (`?`, `&`) or text; ODBC braces keep `;` inside a value
_FIELD = re.compile(
    r"(?:^|(?<=[;?&\s,(]))(?P<name>[A-Za-z][A-Za-z0-9_.-]{0,40})\s*=\s*"
    r"(?P<secret>\{[^}]*\}|\"[^\"]*\"|'[^']*'|[^\s;&#,)'\"]+)"
)
# connection-string keywords that are credentials without an English name
_FIELD_NAMES = frozenset({"pwd", "sig", "sas", "accountkey", "sharedaccesskey", "sharedaccesssignature"})
_URL = re.compile(r"\b(?:https?|wss?)://(?P<host>[^\s/?#'\"]{1,256})(?P<path>/[^\s?#'\"]{0,4096})?")
_TELEGRAM_BOT = re.compile(r"^bot\d+:[A-Za-z0-9_-]{20,}$")
# path segments named like credentials that name a place, not the value after them: /oauth/authorize, /auth/login
_PLACES = frozenset({"auth", "oauth", "authorization", "session", "sessions", "credentials", "signature", "cookie"})
_KNOWN_TOKENS = re.compile(
    r"(?<![A-Za-z0-9_-])(?P<secret>"
    r"gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{40,}|glpat-[A-Za-z0-9_-]{20,}|hf_[A-Za-z0-9]{30,}"
    r"|sk-(?:proj-|ant-)?(?=[A-Za-z_-]*[0-9])[A-Za-z0-9_-]{20,}|xox[abposr]-[A-Za-z0-9-]{10,}|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|AIza[0-9A-Za-z_-]{35}"
    r")(?![A-Za-z0-9_-])"
)


def _field_is_secret(name: str) -> bool:
    compact = re.sub(r"[\s_.-]", "", name).lower()
    return compact in _FIELD_NAMES or is_secret_name(name)


def _url_path_spans(match: re.Match[str]) -> list[Span]:
    """The credential in a URL's path: a webhook's path, or the segment after one named like a credential."""
    host, path = match.group("host").lower(), match.group("path") or ""
    start = match.start("path") if path else match.end()
    segments: list[tuple[int, str]] = []  # (offset in the text, segment)
    offset = start
    for segment in path.split("/"):
        segments.append((offset, segment))
        offset += len(segment) + 1
    segments = [(at, seg) for at, seg in segments if seg]
    if "hook" in host.split(".")[0] and len(segments) > 1:  # hooks.slack.com/services/<the credential>
        return [Span(segments[1][0], match.end(), "a webhook URL's path")]
    for n, (at, segment) in enumerate(segments):
        lower = segment.lower()
        if "hook" in lower and n + 1 < len(segments):  # discord.com/api/webhooks/<id>/<token>, .../webhookb2/...
            return [Span(segments[n + 1][0], match.end(), "a webhook URL's path")]
        if _TELEGRAM_BOT.match(segment):
            return [Span(at + segment.index(":") + 1, at + len(segment), "a bot token in a URL")]
        if n + 1 < len(segments) and is_secret_name(segment) and lower not in _PLACES:  # https://host/token/<value>
            nxt_at, nxt = segments[n + 1]
            return [Span(nxt_at, nxt_at + len(nxt), f"the {segment} in a URL's path")]
    return []


def secret_spans(text: str) -> list[Span]:
    """Where `text` holds credentials by their shape (the module docstring), sorted, none overlapping."""
    if not text:
        return []
    spans: list[Span] = []
    if "://" in text:
        spans += [Span(m.start("secret"), m.end("secret"), "a password in a URL") for m in _USERINFO.finditer(text)]
        for match in _URL.finditer(text):
            spans += _url_path_spans(match)
    if "=" in text:
        for match in _FIELD.finditer(text):
            if _field_is_secret(match.group("name")):
                value_start, value_end = match.span("secret")
                if ";" in text and (match.start() == 0 or text[match.start() - 1] == ";"):
                    value_end = _field_end(text, value_start, value_end)
                if text[value_start] in "{\"'" and value_end - value_start >= 2:  # keep the quotes or braces
                    value_start, value_end = value_start + 1, value_end - 1
                if value_end > value_start:
                    spans.append(Span(value_start, value_end, f"a {match.group('name').strip()}= field"))
    spans += [Span(m.start(), m.end(), "a token of a well-known service") for m in _KNOWN_TOKENS.finditer(text)]
    # an interpolation names a value, it does not hold one (`pg://bob:${oc.env:PW}@host`); a mask hides it already
    spans = [span for span in spans if not _not_a_secret(text[span.start : span.end])]
    return _merged(spans)


def _not_a_secret(part: str) -> bool:
    return is_reference(part) or part == "<redacted>" or set(part) == {"*"}


def interpolations(text: str) -> list[tuple[int, int]]:
    """Where OmegaConf's `${...}` interpolations stand in `text` (nested ones inside their outer one)."""
    found: list[tuple[int, int]] = []
    at = text.find("${")
    while at >= 0:
        depth, end = 0, -1
        for i in range(at, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    end = i + 1
                    break
        if end < 0:  # unbalanced: not an interpolation
            break
        if at == 0 or text[at - 1] != "\\":  # `\${` is OmegaConf's escape: literal text
            found.append((at, end))
        at = text.find("${", end)
    return found


def is_reference(text: str) -> bool:
    """The whole of `text` is one interpolation, `${oc.env:WANDB_API_KEY}`: it names a value (anything else holding
    `${` is taken literally when it is a credential: a password may hold those characters)."""
    return interpolations(text) == [(0, len(text))]


def _field_end(text: str, start: int, end: int) -> int:
    """Where a connection string's field ends: at `;` (a SAS holds `&`, a password spaces), or, where that stretch
    reads on as text (another `=`: a message quoting the field), at the first space."""
    stops = [i for i in (text.find(";", end), text.find("\n", end)) if i >= 0]
    stretch_end = min(stops) if stops else len(text)
    stretch = text[start:stretch_end]
    if "=" in text[end:stretch_end] and (space := re.search(r"\s", stretch)):
        return start + space.start()
    return stretch_end


def _merged(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for span in sorted(spans):
        if out and span.start < out[-1].end:
            last = out[-1]
            out[-1] = Span(last.start, max(last.end, span.end), last.what)
        else:
            out.append(span)
    return out


def redact_shapes(text: str, replacement: str) -> str:
    """`text` with every credential found by its shape replaced."""
    spans = secret_spans(text)
    for span in reversed(spans):
        text = text[: span.start] + replacement + text[span.end :]
    return text
