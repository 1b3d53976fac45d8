"""Secrets by name and by shape (issue 31 §4): the two classifiers (ds_exp/config/secret_names.py,
ds_exp/config/secret_shapes.py) on generated spellings and values, both ways; and what the command line and config
files make of what they find (ds_exp/config/secrets.py): the secret moves into a DS_EXP_SECRET_* variable, the rest
of the value stays readable, and the composed config resolves to the value given."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ds_exp.config.paths import conf_dir
from ds_exp.config.secret_names import is_secret_name
from ds_exp.config.secret_shapes import is_reference, redact_shapes
from ds_exp.config.secrets import REDACTED, hide_secret_overrides, redact_text, register_secrets
from ds_exp.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- names

CREDENTIALS = [
    ("api", "token"), ("github", "token"), ("hf", "token"), ("wandb", "key"), ("api", "keys"), ("auth", "tokens"),
    ("access", "tokens"), ("client", "secret"), ("private", "key"), ("passwd",), ("credentials",), ("db", "password"),
    ("openai", "api", "key"), ("gh", "pat"), ("slack", "bot", "token"), ("aws", "secret", "access", "key"),
    ("hf", "hub", "token"), ("github", "tokens"), ("acme", "token"), ("session", "id"), ("refresh", "token"),
]  # fmt: skip
NOT_CREDENTIALS = [
    ("max", "tokens"), ("num", "tokens"), ("tokenizer",), ("keep", "last"), ("num", "key", "value", "heads"),
    ("key", "value", "heads"), ("max", "new", "tokens"), ("special", "tokens"), ("unexpected", "keys"),
    ("sort", "keys"), ("pad", "token", "id"), ("eos", "token"), ("monkey", "patch"), ("hotkey",), ("token", "count"),
    ("password", "file"), ("api", "key", "env"), ("auth", "type"), ("total", "tokens"), ("added", "tokens"),
    ("exclude", "keys"), ("max", "token"), ("tokens",), ("keys",), ("secret", "name"), ("first", "pass"),
]  # fmt: skip


def spellings(words: tuple[str, ...]) -> set[str]:
    """Every way a name is written: snake, SCREAMING, kebab, dotted, camelCase, PascalCase, run together."""
    forms = {"_".join(words), "_".join(words).upper(), "-".join(words), "-".join(words).upper(), ".".join(words)}
    forms |= {words[0] + "".join(w.title() for w in words[1:]), "".join(w.title() for w in words)}
    forms |= {"".join(words), "".join(words).upper()}
    return forms


@pytest.mark.parametrize(
    ("words", "secret"),
    [(w, True) for w in CREDENTIALS] + [(w, False) for w in NOT_CREDENTIALS],
    ids=["_".join(w) for w in CREDENTIALS + NOT_CREDENTIALS],
)
def test_a_name_is_a_credential_however_it_is_spelt(words, secret):
    """Case, `_`, `-`, `.`, camelCase and words run together: the verdict is the same for every spelling."""
    assert {name: is_secret_name(name) for name in spellings(words)} == dict.fromkeys(spellings(words), secret)


# ---------------------------------------------------------------- shapes

JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
SSH_KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5v\n-----END OPENSSH PRIVATE KEY-----"
PYPI_TOKEN = "pypi-AgEIcHlwaS5vcmcCJGE4ZmQ0ZjRmLTg4YjgtNDAwNC1hYTM5LTU0MTc3ZjQzNzcxNQACJXsicGVybWlzc2lvbnMiOiAidXNlciJ9"

SHAPES = [
    # (text, what stays of it)
    ("postgresql://bob:hunter2@db.example.com:5432/x", "postgresql://bob:<R>@db.example.com:5432/x"),
    ("https://u:p@ss@h.io/x", "https://u:<R>@h.io/x"),  # a password holding "@"
    ("mysql://me:hunter2@db.example/optuna", "mysql://me:<R>@db.example/optuna"),
    (
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=abc123==;EndpointSuffix=core.windows.net",
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=<R>;EndpointSuffix=core.windows.net",
    ),
    (
        "Server=tcp:x;Database=d;User ID=u;Password=S3 cr3t!;Encrypt=True",
        "Server=tcp:x;Database=d;User ID=u;Password=<R>;Encrypt=True",
    ),
    ("Driver={ODBC};Server=s;UID=u;PWD={p;w}", "Driver={ODBC};Server=s;UID=u;PWD={<R>}"),
    (
        "Endpoint=sb://ns/;SharedAccessKeyName=Root;SharedAccessKey=k3y=",
        "Endpoint=sb://ns/;SharedAccessKeyName=Root;SharedAccessKey=<R>",
    ),
    (
        "BlobEndpoint=https://a.net/;SharedAccessSignature=sv=2020&sig=abc%2F",
        "BlobEndpoint=https://a.net/;SharedAccessSignature=<R>",
    ),
    (
        "https://a.blob.core.windows.net/c/x.jsonl?sv=2020&sig=AbC%2B123&sp=r",
        "https://a.blob.core.windows.net/c/x.jsonl?sv=2020&sig=<R>&sp=r",
    ),
    ("https://hooks.slack.com/services/T000/B000/XXXXYYYY", "https://hooks.slack.com/services/<R>"),
    ("https://discord.com/api/webhooks/123456/abcDEF-ghi", "https://discord.com/api/webhooks/<R>"),
    ("https://example.com/api/token/abcdef123/x", "https://example.com/api/token/<R>/x"),
    (
        "https://api.telegram.org/bot123456:ABCdefGHIjklMNOpqrSTUvwx/sendMessage",
        "https://api.telegram.org/bot123456:<R>/sendMessage",
    ),
    ("ghp_abcdefghijklmnopqrstuvwxyz0123456789", "<R>"),
    ("hf_abcdefghijklmnopqrstuvwxyzABCDEFGH", "<R>"),
    ("connecting with api_key='sk-x1' and max_tokens=5", "connecting with api_key='<R>' and max_tokens=5"),
    # issue 39 §2: the shapes that passed in clear, found by detect-secrets' typed plugins or ds_exp's own patterns
    (f"token {JWT} expires", "token <R> expires"),
    (f"aws_secret_access_key={AWS_SECRET}", "aws_secret_access_key=<R>"),
    (AWS_SECRET, "<R>"),  # under an innocent key, by its shape alone
    ("Authorization: Bearer 0b7e3f1a9c2d4e5f6a7b8c9d", "Authorization: Bearer <R>"),
    ("Authorization: Basic dXNlcjpodW50ZXIyMDI2", "Authorization: Basic <R>"),
    (f"key: {SSH_KEY} (deploy)", "key: <R> (deploy)"),
    ("sk_live_4eC39HqLyjWDarjtT1zdp7dc", "<R>"),
    (f"{PYPI_TOKEN}", "<R>"),
    ("ya29.a0AfH6SMBx3Kc9dBQ7kQeXm1JNdD0sVUvJqQJW9z2", "<R>"),
    ("npm_abcdefghijklmnopqrstuvwxyz0123456789", "<R>"),
    ("xapp-1-A0123456789-1234567890123-abcdef0123456789abcdef", "<R>"),
]
NOT_SHAPES = [
    "https://example.com/oauth/authorize", "/data/token/x.jsonl", "s3://bucket/key/file.jsonl", "hf_model",
    "http://localhost:5000", "https://huggingface.co/org/model/resolve/main/tokenizer.json", "sk-learn-experiment-run",
    "postgresql://bob:${oc.env:PW}@h/x", "outputs/default/2026-01-01_00-00-00", "train.max_steps=8 lora.dim=64",
    "key_value_heads=8", "Data Source=server;Initial Catalog=db;User ID=u", "sqlite:///outputs/optuna.db",
    # ids and digests that are no credential: a sha256, a cache key, a 40-character path of words, a git commit
    "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", "sft-15fe7e2d48ee52002c7a",
    "Models/Llama/CheckpointsFinal/Step1000aa", "b449bc0e964c1aa845cec7a7095d048b21bb730a",
    "outputs/default/2026-11-26_18-40-55/checkpoints/step250", "Bearer of good news",
]  # fmt: skip


@pytest.mark.parametrize(("text", "kept"), SHAPES, ids=[s[0][:40] for s in SHAPES])
def test_a_value_holding_a_credential_by_its_shape_keeps_only_the_rest(text, kept):
    assert redact_shapes(text, "<R>") == kept


def test_what_only_looks_like_a_credential_is_left_alone():
    assert [text for text in NOT_SHAPES if redact_shapes(text, "<R>") != text] == []


def _leaves(node: object) -> list[object]:
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in (key, *_leaves(value))]
    if isinstance(node, list):
        return [leaf for value in node for leaf in _leaves(value)]
    return [node]


def test_no_value_of_ds_exps_own_config_files_looks_like_a_credential():
    """Every value conf/ and the README's commands hold is left alone: the detectors must not blank a run's settings."""
    texts = [str(value) for p in conf_dir().rglob("*.yaml") for value in _leaves(yaml.safe_load(p.read_text()))]
    texts += [line for line in (REPO / "README.md").read_text().splitlines() if "python -m ds_exp" in line]
    assert [text for text in texts if redact_shapes(text, "<R>") != text] == []


PASSWORDS = ["hunter2", "p@ss:w0rd", "a%2Fb%40c", "${not}an{interp}", "x" * 40, "Zz9-_.~!*"]


@pytest.mark.parametrize(
    ("scheme", "password"), itertools.product(["postgresql", "redis", "mongodb+srv", "https"], PASSWORDS)
)
def test_a_urls_password_is_hidden_whatever_it_holds(scheme, password):
    text = f"{scheme}://alice:{password}@db-1.example.com:5432/base?x=1"
    assert redact_shapes(text, "<R>") == f"{scheme}://alice:<R>@db-1.example.com:5432/base?x=1"


FIELDS = [
    "AccountKey", "accountkey", "ACCOUNTKEY", "Password", "password", "pwd", "PWD", "SharedAccessSignature",
    "sharedaccesskey", "sig", "token", "api-key", "client_secret",
]  # fmt: skip


@pytest.mark.parametrize("field", FIELDS)
def test_a_connection_strings_credential_field_is_hidden_however_it_is_spelt(field):
    for password in PASSWORDS[:4]:
        text = f"Server=tcp:db.example.com;Database=d;{field}={password};Encrypt=True"
        assert redact_shapes(text, "<R>") == f"Server=tcp:db.example.com;Database=d;{field}=<R>;Encrypt=True"


def test_a_reference_is_one_whole_interpolation():
    assert is_reference("${oc.env:WANDB_API_KEY}") and is_reference("${oc.env:A,${b}}")
    assert not any(map(is_reference, ["ab${cd}ef", "${a}${b}", "Bearer ${oc.env:T}", "${a", "\\${a}", "plain"]))


def test_a_library_error_that_quotes_a_secret_is_redacted():
    """register_secrets keeps the secret parts of every value (and of the environment's): an exception's text that
    quotes one is blanked, even out of its URL; and any text shaped like a secret is blanked, registered or not."""
    register_secrets(
        {"logger": {"notes": "postgresql://bob:reg-pw-9f3a21@db/x"}}, environ={"X_URI": "redis://:env-pw-44c1d0@r"}
    )
    message = "OperationalError: password authentication failed (reg-pw-9f3a21); env-pw-44c1d0 rejected"
    assert redact_text(message) == f"OperationalError: password authentication failed ({REDACTED}); {REDACTED} rejected"
    assert (
        redact_text("could not reach mysql://me:never-registered@h/db") == f"could not reach mysql://me:{REDACTED}@h/db"
    )


# ---------------------------------------------------------------- hidden on the command line and in config files


@pytest.fixture(autouse=True)
def restored_environ():
    """Composing writes a config file's secrets into os.environ (DS_EXP_SECRET_FILE_*): none outlives the test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _composed(overrides: list[str], environ: dict[str, str], monkeypatch, search: str | None = None):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    extra = [f"hydra.searchpath=[file://{search}]"] if search else []
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=[*overrides, *extra], return_hydra_config=True)


BY_SHAPE = {
    "+logger.notes": "postgresql://bob:cli-pw-7e21aa@db.example.com/x",
    "+logger.hook": "https://hooks.slack.com/services/T000/B000/cliHookSecret1",
    "+logger.conn": "AccountName=acct;AccountKey=cli-acct-key-55==;EndpointSuffix=core.windows.net",
    "+logger.gh_pat": "cli-${literal}-pat-0c1d",  # `${` in a secret: taken literally
    "+hydra.job.env_set.OPENAI": "cli-envset-9a8b7c",  # a variable of the job, whatever its name
    "+logger.apitoken": "cli-apitoken-5f5f5f",
}


def test_secrets_by_shape_and_place_move_into_the_environment_and_resolve(monkeypatch):
    environ: dict[str, str] = {}
    args = [f"{key}='{value}'" if ";" in value else f"{key}={value}" for key, value in BY_SHAPE.items()]
    hidden = hide_secret_overrides(
        [*args, "+hydra.job.env_set.OMP_NUM_THREADS=4", "logger.wandb.api_key=${oc.env:K}"], environ
    )
    text = " ".join(hidden)
    assert not [value for value in BY_SHAPE.values() if value in text], hidden
    # the rest of a value stays readable: the user, the host, the field names
    assert "postgresql://bob:${oc.env:DS_EXP_SECRET_LOGGER_NOTES}@db.example.com/x" in text
    assert "AccountName=acct;AccountKey=${oc.env:DS_EXP_SECRET_LOGGER_CONN}" in text
    assert "+hydra.job.env_set.OMP_NUM_THREADS=4" in hidden and "logger.wandb.api_key=${oc.env:K}" in hidden
    cfg = _composed(hidden, environ | {"K": "k"}, monkeypatch)
    for key, value in BY_SHAPE.items():
        assert OmegaConf.select(cfg, key.lstrip("+")) == value
    saved = OmegaConf.to_yaml(cfg)  # what Hydra writes to .hydra/
    assert not [value for value in BY_SHAPE.values() if value in saved]


def test_a_config_files_secrets_by_shape_and_place_become_interpolations(tmp_path, monkeypatch):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "shapes.yaml").write_text(
        "# @package _global_\n"
        "logger:\n"
        "  mlflow:\n"
        "    tracking_uri: mysql://me:file-pw-31ab@db.example/optuna\n"
        "    tags: {hook: 'https://discord.com/api/webhooks/123/file-hook-4c4c', ref: 'pg://bob:${oc.env:HOME}@h/x'}\n"
        "deepspeed: {config: {acme: {password: 'file-${literal}-8e8e'}}}\n"  # `${` in a secret: taken literally
        "hydra: {job: {env_set: {UPLOAD: file-envset-2d2d, OMP_NUM_THREADS: 4}}}\n"
    )
    cfg = _composed(["experiment=shapes"], {}, monkeypatch, search=str(tmp_path))
    saved = OmegaConf.to_yaml(cfg)
    assert "file-" not in saved, saved
    assert "tracking_uri: mysql://me:${oc.env:DS_EXP_SECRET_FILE_LOGGER_MLFLOW_TRACKING_URI}@db.example/optuna" in saved
    assert "ref: pg://bob:${oc.env:HOME}@h/x" in saved and "OMP_NUM_THREADS: '4'" in saved  # a reference, a number
    assert cfg.logger.mlflow.tracking_uri == "mysql://me:file-pw-31ab@db.example/optuna"
    assert cfg.logger.mlflow.tags.hook == "https://discord.com/api/webhooks/123/file-hook-4c4c"
    assert cfg.deepspeed.config.acme.password == "file-${literal}-8e8e"
    assert cfg.hydra.job.env_set.UPLOAD == "file-envset-2d2d"
    assert os.environ["DS_EXP_SECRET_FILE_HYDRA_JOB_ENV_SET_UPLOAD"] == "file-envset-2d2d"


def test_one_hook_hides_a_compositions_secrets_however_often_runs_install_it(monkeypatch):
    """Each in-process run (the Python API, the tests' in-process CLI) installs the hook again: a composition still
    runs it once (a hook per run so far piled up: seconds a composition after a few hundred runs)."""
    from ds_exp.config import secrets

    hidden = []
    monkeypatch.setattr(secrets, "hide_config_file_secrets", lambda cfg, environ: hidden.append(cfg))
    for _ in range(3):
        secrets.hide_secrets_when_composing()
    _composed([], {}, monkeypatch)
    assert len(hidden) == 1


def test_a_run_started_with_added_keys_continues_with_resume_auto(tmp_path, monkeypatch):
    """`+logger.gh_pat=...` (or any `+key=`) on the first attempt: its saved config holds a key the schema lacks,
    which the typed merge of a resume refused ("Key 'gh_pat' not in 'LoggerConfig'"). The keys an attempt added are
    taken back; a secret whose variable is gone with its process is left unset, never guessed."""
    from ds_exp.launch.run_config import continue_run_config

    environ: dict[str, str] = {}
    first = hide_secret_overrides(
        ["+logger.gh_pat=first-pat-61f0", "+train.my_note=kept", "train.max_steps=20"], environ
    )
    run = tmp_path / "R"
    (run / ".hydra").mkdir(parents=True)
    config = _composed(first, environ, monkeypatch)
    OmegaConf.save(OmegaConf.masked_copy(config, [k for k in config if k != "hydra"]), run / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(first), run / ".hydra" / "overrides.yaml")  # as Hydra saves them
    for name in environ:
        monkeypatch.delenv(name)  # a later process: the first one's variables are gone

    again = _composed([f"hydra.run.dir={run}", "resume=auto"], {}, monkeypatch)
    changed = continue_run_config(again, run, ["resume=auto"])
    assert again.train.my_note == "kept" and again.train.max_steps == 20 and again.logger.gh_pat is None
    assert changed == ["logger.gh_pat: ${oc.env:DS_EXP_SECRET_LOGGER_GH_PAT} -> None"]
    # a key the run never added is one the schema lost: still named, not taken
    (run / ".hydra" / "overrides.yaml").write_text("[]\n")
    with pytest.raises(ConfigError, match="Key 'my_note' not in 'TrainConfig'"):
        continue_run_config(_composed([f"hydra.run.dir={run}", "resume=auto"], {}, monkeypatch), run, ["resume=auto"])
