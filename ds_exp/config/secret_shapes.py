"""Which parts of a value are credentials whatever its key, by their shape: a URL's password; a connection string's or
query's field named like a credential (`AccountKey=`, `&sig=`); a webhook URL's path; tokens that say what they are
(detect-secrets' typed plugins, plus `_OWN_TOKENS`). Entropy and keyword plugins flag hashes and ids, so are not used.
Light: detect-secrets loads lazily."""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from typing import Any, NamedTuple

from ds_exp.config.secret_names import is_secret_name


class Span(NamedTuple):
    start: int
    end: int
    what: str  # for messages: "a password in a URL", ...


# scheme://[user]:password@host: the password may hold "@"; bounded repeats scan long text in linear time
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
# What detect-secrets' typed plugins (1.5) miss, checked against them in tests/unit/test_secrets.py
_OWN_TOKENS = re.compile(
    r"(?<![A-Za-z0-9_-])(?P<secret>"
    r"hf_[A-Za-z0-9]{30,}|glpat-[A-Za-z0-9_-]{20,}|github_pat_[A-Za-z0-9_]{40,}"
    r"|sk-(?:proj-|ant-)?(?=[A-Za-z_-]*[0-9])[A-Za-z0-9_-]{20,}|xox[abposr]-[A-Za-z0-9-]{10,}|xapp-\d-[A-Za-z0-9-]{20,}"
    r"|AIza[0-9A-Za-z_-]{35}|ya29\.[0-9A-Za-z_-]{20,}|npm_[A-Za-z0-9]{36,}"
    r")(?![A-Za-z0-9_-])"
)
# an HTTP Authorization value (a header pasted into a config or an error): the credential after its scheme
_AUTHORIZATION = re.compile(r"\b(?:Bearer|Basic|Token)\s+(?P<secret>[A-Za-z0-9._~+/-]{8,}=*)")
# a whole private key block: detect-secrets finds its BEGIN line; the key is everything to its END line
_PRIVATE_KEY = re.compile(
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|\Z)", re.S
)
# an AWS secret access key: 40 characters of base64, random (an identifier or a path of words is not)
_AWS_SECRET = re.compile(r"(?<![A-Za-z0-9/+=])(?P<secret>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])")
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~+/=")
_MIN_TOKEN = 16  # no typed token is shorter: shorter texts are not scanned by detect-secrets
# detect-secrets' plugins that judge by entropy, keyword or address rather than a token's own format
_UNTYPED_PLUGINS = frozenset({"Base64HighEntropyString", "HexHighEntropyString", "KeywordDetector", "IPPublicDetector"})


@functools.cache
def _typed_plugins() -> tuple[Any, ...]:
    """detect-secrets' plugins that know a token by its format, each once."""
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class

    plugins: list[Any] = list(get_mapping_from_secret_type_to_class().values())  # detect-secrets has no types
    return tuple(cls() for cls in plugins if cls.__name__ not in _UNTYPED_PLUGINS)


def _token_spans(text: str, own: list[Span]) -> list[Span]:
    """Tokens that say what they are: ds_exp's own patterns, and detect-secrets' typed plugins where `own` has none."""
    spans = [Span(m.start(), m.end(), "a token of a well-known service") for m in _OWN_TOKENS.finditer(text)]
    spans += [Span(*m.span("secret"), "an Authorization header's credential") for m in _AUTHORIZATION.finditer(text)]
    spans += [Span(m.start(), m.end(), "a private key") for m in _PRIVATE_KEY.finditer(text)]
    spans += [Span(*m.span("secret"), "an AWS secret access key") for m in _AWS_SECRET.finditer(text) if _random(m[0])]
    if len(text) < _MIN_TOKEN:
        return spans
    for plugin in _typed_plugins():
        for regex in plugin.denylist:
            for match in regex.finditer(text):
                # a plugin's group is the secret where it is one (AWS's 40 characters after "aws...="), not where it
                # is the token's prefix (GitHub's `(ghp|gho|...)_`)
                groups = [match.span(g) for g in range(1, regex.groups + 1) if match.group(g)]
                start, end = max(groups, key=lambda s: s[1] - s[0], default=(0, 0))
                if end - start < 8:
                    start, end = match.span()
                while end < len(text) and text[end] in _TOKEN_CHARS:  # JWT's pattern stops lazily before the signature
                    end += 1
                if not any(s.start < end and start < s.end for s in own):
                    spans.append(Span(start, end, f"a {plugin.secret_type}"))
    return spans


def _random(token: str) -> bool:
    """Mixed case and digits, and the entropy of random base64 (words and paths stay under 4.3 bits a character)."""
    if not (any(c.isdigit() for c in token) and any(c.islower() for c in token) and any(c.isupper() for c in token)):
        return False
    counts = Counter(token)
    return -sum(n / len(token) * math.log2(n / len(token)) for n in counts.values()) > 4.3


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
            name = match.group("name")
            if re.sub(r"[\s_.-]", "", name).lower() in _FIELD_NAMES or is_secret_name(name):
                value_start, value_end = match.span("secret")
                if ";" in text and (match.start() == 0 or text[match.start() - 1] == ";"):
                    value_end = _field_end(text, value_start, value_end)
                if text[value_start] in "{\"'" and value_end - value_start >= 2:  # keep the quotes or braces
                    value_start, value_end = value_start + 1, value_end - 1
                if value_end > value_start:
                    spans.append(Span(value_start, value_end, f"a {name.strip()}= field"))
    spans += _token_spans(text, spans)
    # an interpolation names a value, it does not hold one (`pg://bob:${oc.env:PW}@host`); a mask hides it already
    parts = [(span, text[span.start : span.end]) for span in spans]
    return _merged([s for s, part in parts if not (is_reference(part) or part == "<redacted>" or set(part) == {"*"})])


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
    """The whole of `text` is one interpolation, `${oc.env:WANDB_API_KEY}`: it names a value, it holds none."""
    return interpolations(text) == [(0, len(text))]


def _field_end(text: str, start: int, end: int) -> int:
    """Where a connection string's field ends: at `;`, or at the first space where the stretch reads on as text."""
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
