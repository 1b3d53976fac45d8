"""Secrets given on the command line, in a config file or in the environment never reach a file a run writes. A secret
is a value under a credential's name (secret_names.py), the part of a value whose shape gives it away
(secret_shapes.py), or a text value of `hydra.job.env_set`. Each is moved into a DS_EXP_SECRET_* environment variable
with `${oc.env:...}` left in its place, so Hydra saves the interpolation and every process inherits the value; `redact`
and `redact_text` blank them in what is saved, sent or logged. Import-light: no torch."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, DictKeyType, OmegaConf, flag_override

from ds_exp.config.command_line import parse_override
from ds_exp.config.secret_names import is_secret_name
from ds_exp.config.secret_shapes import is_reference, redact_shapes, secret_spans
from ds_exp.core.compat import on_compose
from ds_exp.core.errors import ConfigError

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

REDACTED = "<redacted>"
ENV_PREFIX = "DS_EXP_SECRET_"
_MIN_SECRET_LEN = 6  # shorter values would redact ordinary words
_secrets: set[str] = set()


is_secret_key = is_secret_name


def holds_secret(value: object) -> bool:
    """What a credential key may hold: not None, and never a flag (`private: true` is a setting, not a secret)."""
    return value is not None and not isinstance(value, bool)


ENV_SET = "hydra.job.env_set."  # a variable the job gets: a secret by its place


def is_env_set_value(key: str, value: object) -> bool:
    """A text value of hydra.job.env_set.NAME (Hydra's schema makes numbers and flags text too: those are settings)."""
    return (
        key.startswith(ENV_SET)
        and isinstance(value, str)
        and not re.fullmatch(r"[-+]?\d+(\.\d*)?|true|false|yes|no|on|off", value, re.IGNORECASE)
    )


def redact(tree: object) -> Any:
    """Blank every value under a secret's key, and every registered secret value wherever it stands."""
    if isinstance(tree, dict):
        return {k: (REDACTED if is_secret_key(k) and holds_secret(v) else redact(v)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    if isinstance(tree, str):
        return redact_text(tree)
    return tree


def register_secrets(tree: object = None, environ: Mapping[str, str] | None = None) -> None:
    """Remember the secret values of a config tree and of the environment, so that `redact_text` blanks them."""

    def walk(node: object, secret: bool) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, secret or is_secret_key(key))
        elif isinstance(node, list):
            for value in node:
                walk(value, secret)
        elif isinstance(node, str):
            found = [node] if secret else [node[span.start : span.end] for span in secret_spans(node)]
            _secrets.update(value for value in found if len(value) >= _MIN_SECRET_LEN)

    walk(tree, False)
    environ = environ or {}
    walk({k: v for k, v in environ.items() if is_secret_key(k)}, True)
    walk([v for k, v in environ.items() if not is_secret_key(k)], False)  # MLFLOW_TRACKING_URI=https://u:PW@...
    if _secrets:
        _redact_log_records()


def redact_text(text: str) -> str:
    """`text` with every registered secret, and every secret found by its shape, blanked."""
    for value in _secrets:
        if value in text:
            text = text.replace(value, REDACTED)
    return redact_shapes(text, REDACTED)


_factory_installed = False


def _redact_log_records() -> None:
    """Blank registered secrets in every log record as it is made, whatever logger it goes to, tracebacks included."""
    global _factory_installed
    if _factory_installed:
        return
    _factory_installed = True
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: the handler reports it as it would have
            return record
        if (redacted := redact_text(message)) != message:
            record.msg, record.args = redacted, None
        if record.exc_info and record.exc_info[1] is not None:
            text = logging.Formatter().formatException(record.exc_info)
            if (redacted := redact_text(text)) != text:
                record.exc_text = redacted  # formatters use it instead of formatting exc_info again
        return record

    logging.setLogRecordFactory(factory)


def secret_env_name(key: str, prefix: str = ENV_PREFIX) -> str:
    return prefix + re.sub(r"\W+", "_", key).strip("_").upper()


_from_command_line: dict[str, str] = {}  # the variables hide_secret_overrides set in this process


def secret_inside(value: object) -> bool:
    """A dict (or list of them) holding a credential key with a value, or a text holding a secret by its shape."""
    if isinstance(value, dict):
        return any((is_secret_key(k) and holds_secret(v)) or secret_inside(v) for k, v in value.items())
    if isinstance(value, list):
        return any(secret_inside(v) for v in value)
    if isinstance(value, str):
        return bool(secret_spans(value))
    options = getattr(value, "list", None)  # a choice sweep's
    return isinstance(options, list) and secret_inside(options)


class _Variables:
    """The DS_EXP_SECRET_* variables of one command line: two keys that spell the same name get distinct ones."""

    def __init__(self, environ: MutableMapping[str, str]) -> None:
        self.environ, self.names = environ, dict[str, str]()

    def move(self, key: str, value: str) -> str:
        """`value` into a variable named after `key`; returns the interpolation that reads it."""
        name = secret_env_name(key)
        while self.names.setdefault(name, key) != key:
            name += "_"
        self.environ[name] = _from_command_line[name] = value
        register_secrets(environ={name: value})
        return f"${{oc.env:{name}}}"

    def move_parts(self, key: str, value: str) -> str:
        """`value` with each secret part found by its shape moved into a variable of its own."""
        spans = secret_spans(value)
        for n, span in reversed(list(enumerate(spans, 1))):
            reference = self.move(key if len(spans) == 1 else f"{key}_{n}", value[span.start : span.end])
            value = value[: span.start] + reference + value[span.end :]
        return value


def _quoted(key_text: str, value: str) -> str | None:
    """`key_text='value'` as Hydra reads it back to `value` exactly; None when no quoting does."""
    arg = f"{key_text}='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    parsed = parse_override(arg)
    return arg if parsed is not None and parsed.value() == value else None


def hide_secret_overrides(args: Iterable[str], environ: MutableMapping[str, str]) -> list[str]:
    """The command line with every secret value moved into `environ`. Refused without showing it: a sweep over a secret,
    one inside a dict value, `~key=VALUE`, and secrets under `hydra.*` (but env_set and sweeper.storage)."""
    out: list[str] = []
    problems: list[str] = []
    variables = _Variables(environ)
    for arg in args:
        if arg.startswith("-") or "=" not in arg:  # flags, their values, `~key`
            out.append(arg)
            continue
        key_text, _, raw = arg.partition("=")
        override = parse_override(arg)
        literal = False
        if override is None:
            # Hydra's grammar rejects the value (a base64 key ending in "=", `Server=s;Password=p`); a secret is
            # the text after the first "=" as it is, anything else is left for Hydra to report
            override, literal = parse_override(f"{key_text}=x"), True
            if override is None:
                last = re.split(r"\W+", key_text.strip("+~"))[-1]
                if is_secret_key(last) or secret_spans(raw):
                    problems.append(f"{key_text}=...: not a valid override (the value is not shown)")
                else:
                    out.append(arg)
                continue
        key = override.key_or_group if override.package is None else f"{override.key_or_group}@{override.package}"
        value: Any = raw if literal else override.value()  # Hydra's union; past _refusal a str, or None
        flag = not literal and isinstance(value, bool)  # `+hub.private=true` is a setting, not a secret
        by_name = not flag and is_secret_key(re.split(r"[./@]", key)[-1])
        if not (by_name or is_env_set_value(key, value)):
            if isinstance(value, str) and secret_spans(value):
                out.append(_hide_parts(override, key, key_text, raw if literal else value, variables, problems))
            elif not literal and secret_inside(value):
                problems.append(f"{key_text}=...: holds a secret inside its value; give it as its own override")
            else:
                out.append(arg)
            continue
        if isinstance(value, (bool, int, float)):
            value = raw  # as typed: a password 1e10 stays "1e10"
        problem = _refusal(override, key, key_text, value)
        if problem:
            problems.append(problem)
        elif value is None or value == "" or is_reference(value):  # nothing to hide, or names a variable
            out.append(arg)
        else:
            out.append(f"{key_text}={variables.move(key, value)}")
    if problems:
        raise ConfigError(
            [*problems, "secrets go in the environment (WANDB_API_KEY, HF_TOKEN, ...) or as key=VALUE on their own"]
        )
    return out


def _hide_parts(
    override: Override, key: str, key_text: str, value: str, variables: _Variables, problems: list[str]
) -> str:
    """`key=VALUE` whose VALUE holds a secret by its shape: the secret parts move, the rest stays readable."""
    problem = _refusal(override, key, key_text, value, allowed=("hydra.job.env_set.", "hydra.sweeper.storage"))
    if problem:
        problems.append(problem)
        return ""
    hidden = variables.move_parts(key, value)
    return _quoted(key_text, hidden) or f"{key_text}={variables.move(key + '_value', value)}"


def _refusal(
    override: Override, key: str, key_text: str, value: object, allowed: tuple[str, ...] = ("hydra.job.env_set.",)
) -> str | None:
    if override.is_sweep_override():
        return f"{key_text}=...: a sweep over a secret is not supported; run one sweep per value"
    if override.is_delete() and value is not None:
        return f"{key_text}=...: delete a secret without its value: {key_text}"
    if isinstance(value, (dict, list)):
        return f"{key_text}=...: a secret must be a single value, not a dict or list"
    if key.startswith(("hydra.", "hydra/")) and not key.startswith(allowed):
        return f"{key_text}=...: Hydra writes its settings into files; put the secret in the environment instead"
    return None


FILE_ENV_PREFIX = ENV_PREFIX + "FILE_"


def hide_config_file_secrets(cfg: DictConfig, environ: MutableMapping[str, str]) -> None:
    """Literal secrets from config files become `${oc.env:DS_EXP_SECRET_FILE_<KEY>}` (by shape: the secret parts only),
    their values moved into `environ`, before the command line applies."""
    found: list[tuple[list[DictKeyType], str, bool]] = []  # (path, value, whole value)

    def walk(node: object, path: list[DictKeyType], secret: bool) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, [*path, key], secret or is_secret_key(key))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, [*path, index], secret)
        elif (secret and holds_secret(node)) or is_env_set_value(".".join(map(str, path)), node):
            if not (isinstance(node, str) and (node in ("", "???") or is_reference(node))):  # ???: unset
                found.append((path, str(node), True))
        elif isinstance(node, str) and secret_spans(node):
            found.append((path, node, False))

    walk(OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False), [], False)
    for path, value, whole in found:
        key = ".".join(map(str, path))
        spans = [(0, len(value))] if whole else [(span.start, span.end) for span in secret_spans(value)]
        for n, (start, end) in reversed(list(enumerate(spans, 1))):
            name = secret_env_name(key if len(spans) == 1 else f"{key}_{n}", FILE_ENV_PREFIX)
            while name in _from_command_line:
                name += "_"
            environ[name] = value[start:end]
            register_secrets(environ={name: value[start:end]})
            value = value[:start] + f"${{oc.env:{name}}}" + value[end:]
        parent = cfg
        for part in path[:-1]:  # by key, not by a dotted path: a key may hold a dot
            parent = parent[part]
        with flag_override(parent, ["readonly", "struct"], False):
            parent[path[-1]] = value


def _hide_composed_secrets(cfg: DictConfig) -> None:
    hide_config_file_secrets(cfg, os.environ)


def hide_secrets_when_composing() -> None:
    """Every composition of this process hides its config files' secrets (see hide_config_file_secrets). One hook
    however often this is called (each in-process run calls it): a fresh lambda each time piled up a hook per run."""
    on_compose(_hide_composed_secrets)
