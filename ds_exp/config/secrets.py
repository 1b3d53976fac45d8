"""Secrets given on the command line, in a config file or in the environment never reach a file a run writes.

Which names hold credentials: ds_exp/secret_names.py (word families, not a list of names).

* `hide_secret_overrides` runs before Hydra parses the command line. An override whose key looks like a
  credential, `+logger.wandb.api_key=VALUE`, becomes `+logger.wandb.api_key=${oc.env:DS_EXP_SECRET_LOGGER_
  WANDB_API_KEY}` and VALUE moves into that environment variable. Hydra then saves the interpolation, never
  the value (.hydra/*.yaml, multirun.yaml, submitit's pickles); sys.argv, which wandb records as the run's
  arguments, no longer holds it; and the environment carries it to every process of the run (torchrun and
  deepspeed children, submitit's local jobs, SLURM jobs, which get the submitting environment).
* `hide_config_file_secrets` does the same, as Hydra composes, for literal credentials that config files
  (conf/, a --config-dir experiment, a preset) put into the config: `${oc.env:DS_EXP_SECRET_FILE_<KEY>}`.
* `redact` blanks the values of credential keys in configs that are saved or sent (ds_config.json, the
  wandb config, DeepSpeed's checkpoints), and registered values wherever they stand; `redact_text` blanks every
  registered value (the command line's, the config files', the config's credentials and those of
  credential-named environment variables) in text: every log record of the process, error messages.

Import-light (no torch): the CLI calls it before `--help` and `--cfg job`.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, DictKeyType, OmegaConf, flag_override

from ds_exp.config.secret_names import is_secret_name
from ds_exp.core.compat import on_compose
from ds_exp.core.errors import ConfigError

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

REDACTED = "<redacted>"
ENV_PREFIX = "DS_EXP_SECRET_"
_MIN_SECRET_LEN = 6  # shorter values would redact ordinary words
_secrets: set[str] = set()


def is_secret_key(key: object) -> bool:
    """A credential's name, by the well-known families (ds_exp/secret_names.py)."""
    return is_secret_name(key)


def holds_secret(value: object) -> bool:
    """What a credential key may hold: not None, and never a flag (`private: true` is a setting, not a secret)."""
    return value is not None and not isinstance(value, bool)


def redact(tree: object) -> Any:
    """Blank every value whose key looks like a secret, and every registered secret value wherever it stands (a
    `${oc.env:WANDB_API_KEY}` under an innocent key): configs are saved and sent to wandb."""
    if isinstance(tree, dict):
        return {k: (REDACTED if is_secret_key(k) and holds_secret(v) else redact(v)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    if isinstance(tree, str):
        return redact_text(tree)
    return tree


def register_secrets(tree: object = None, environ: Mapping[str, str] | None = None) -> None:
    """Remember the secret values of a config tree and of the environment (WANDB_API_KEY, HF_TOKEN,
    DS_EXP_SECRET_*, ...), so that `redact_text` blanks them wherever they would be printed or logged."""

    def walk(node: object, secret: bool) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, secret or is_secret_key(key))
        elif isinstance(node, list):
            for value in node:
                walk(value, secret)
        elif secret and isinstance(node, str) and len(node) >= _MIN_SECRET_LEN:
            _secrets.add(node)

    walk(tree, False)
    walk({k: v for k, v in (environ or {}).items() if is_secret_key(k)}, True)
    if _secrets:
        _redact_log_records()


def redact_text(text: str) -> str:
    for value in _secrets:
        if value in text:
            text = text.replace(value, REDACTED)
    return text


_factory_installed = False


def _redact_log_records() -> None:
    """Blank registered secrets in every log record as it is made, whatever logger and handler it goes to
    (Hydra's job log, the console that submitit and wandb capture, per-rank files), tracebacks included."""
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


# ------------------------------------------------------------------ the command line


def secret_env_name(key: str, prefix: str = ENV_PREFIX) -> str:
    return prefix + re.sub(r"\W+", "_", key).strip("_").upper()


_from_command_line: dict[str, str] = {}  # the variables hide_secret_overrides set in this process


def _secret_inside(value: object) -> bool:
    """A dict (or list of them) holding a credential key with a value: `+deepspeed.config.comet={api_key:...}`."""
    if isinstance(value, dict):
        return any((is_secret_key(k) and holds_secret(v)) or _secret_inside(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_secret_inside(v) for v in value)
    options = getattr(value, "list", None)  # a choice sweep's
    return isinstance(options, list) and _secret_inside(options)


@functools.cache
def _parser() -> OverridesParser:
    return OverridesParser.create()


def _parse(override: str) -> Override | None:
    """Hydra's own reading of one override (key, +/++/~, value with quotes undone), None where it fails."""
    try:
        return _parser().parse_overrides([override])[0]
    except HydraException:
        return None


def hide_secret_overrides(args: Iterable[str], environ: MutableMapping[str, str]) -> list[str]:
    """The command line with every secret value moved into `environ` (see the module's docstring).

    Refused, with a message that does not show the value: a sweep over a secret (`key=a,b`), a secret inside
    a dict value, `~key=VALUE`, and secret-looking `hydra.*` keys other than `hydra.job.env_set.NAME` (Hydra
    writes its own settings out resolved: sbatch files, the sweeper's job overrides).
    """
    out: list[str] = []
    problems: list[str] = []
    names: dict[str, str] = {}  # variable -> key: two keys that spell the same name get distinct variables
    for arg in args:
        if arg.startswith("-") or "=" not in arg:  # flags, their values, `~key`
            out.append(arg)
            continue
        key_text, _, raw = arg.partition("=")
        override = _parse(arg)
        literal = False
        if override is None:
            # Hydra's grammar rejects the value (a base64 key ending in "="); for a secret key the text after
            # the first "=" is taken as it is, anything else is left for Hydra to report
            override, literal = _parse(f"{key_text}=x"), True
            if override is None:
                last = re.split(r"\W+", key_text.strip("+~"))[-1]
                if is_secret_key(last):
                    problems.append(f"{key_text}=...: not a valid override (the value is not shown)")
                else:
                    out.append(arg)
                continue
        key = override.key_or_group if override.package is None else f"{override.key_or_group}@{override.package}"
        value: Any = override.value()  # Hydra's union; past _refusal a str, or None
        flag = not literal and isinstance(value, bool)  # `+hub.private=true` is a setting, not a secret
        if flag or not is_secret_key(re.split(r"[./@]", key)[-1]):
            if not literal and _secret_inside(value):
                problems.append(f"{key_text}=...: holds a secret inside its value; give it as its own override")
            else:
                out.append(arg)
            continue
        if literal:
            value = raw
        elif isinstance(value, (bool, int, float)):
            value = raw  # as typed: a password 1e10 stays "1e10"
        problem = _refusal(override, key, key_text, value)
        if problem:
            problems.append(problem)
        elif value is None or value == "" or "${" in value:  # nothing to hide, or already an interpolation
            out.append(arg)
        else:
            name = secret_env_name(key)
            while names.setdefault(name, key) != key:
                name += "_"
            environ[name] = _from_command_line[name] = value
            register_secrets(environ={name: value})
            out.append(f"{key_text}=${{oc.env:{name}}}")
    if problems:
        raise ConfigError(
            [*problems, "secrets go in the environment (WANDB_API_KEY, HF_TOKEN, ...) or as key=VALUE on their own"]
        )
    return out


def _refusal(override: Override, key: str, key_text: str, value: object) -> str | None:
    if override.is_sweep_override():
        return f"{key_text}=...: a sweep over a secret is not supported; run one sweep per value"
    if override.is_delete() and value is not None:
        return f"{key_text}=...: delete a secret without its value: {key_text}"
    if isinstance(value, (dict, list)):
        return f"{key_text}=...: a secret must be a single value, not a dict or list"
    if key.startswith(("hydra.", "hydra/")) and not key.startswith("hydra.job.env_set."):
        return f"{key_text}=...: Hydra writes its settings into files; put the secret in the environment instead"
    return None


# ------------------------------------------------------------------ config files

FILE_ENV_PREFIX = ENV_PREFIX + "FILE_"


def _not_a_value(text: str) -> bool:
    """Empty, an interpolation, or `???` (a mandatory value not given yet)."""
    return text in ("", "???") or "${" in text


def hide_config_file_secrets(cfg: DictConfig, environ: MutableMapping[str, str]) -> None:
    """Literal credential values that config files put into a composition (conf/, a --config-dir experiment, a
    preset) become `${oc.env:DS_EXP_SECRET_FILE_<KEY>}` and their values move into `environ`, as the command
    line's do. Called on every composition before the command line's overrides apply (ds_exp.core.compat.
    on_compose), so Hydra saves the interpolation (.hydra/*.yaml before the task runs, multirun.yaml, submitit's
    pickles, `--cfg job`) and the run resolves the value: every process composes for itself, or inherits the
    environment of the one that did (submitit, SLURM)."""
    found: list[tuple[list[DictKeyType], object]] = []

    def walk(node: object, path: list[DictKeyType], secret: bool) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, [*path, key], secret or is_secret_key(key))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, [*path, index], secret)
        elif secret and holds_secret(node) and not (isinstance(node, str) and _not_a_value(node)):
            found.append((path, node))

    walk(OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False), [], False)
    for path, value in found:
        name = secret_env_name(".".join(map(str, path)), FILE_ENV_PREFIX)
        while name in _from_command_line:
            name += "_"
        environ[name] = str(value)
        register_secrets(environ={name: str(value)})
        parent = cfg
        for part in path[:-1]:  # by key, not by a dotted path: a key may hold a dot
            parent = parent[part]
        with flag_override(parent, ["readonly", "struct"], False):
            parent[path[-1]] = f"${{oc.env:{name}}}"


def _hide_in_environ(cfg: DictConfig) -> None:
    hide_config_file_secrets(cfg, os.environ)


def hide_secrets_when_composing() -> None:
    """Every composition of this process hides its config files' secrets (see hide_config_file_secrets)."""
    on_compose(_hide_in_environ)
