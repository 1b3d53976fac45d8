"""Secrets never land in what a run writes; caches hold no pickle; exports are safetensors; a resume never
unpickles arbitrary objects (torch.load with weights_only=True on checkpoint files from an earlier process).

Secrets given on the command line move into DS_EXP_SECRET_* environment variables before Hydra parses it
(ds_exp/config/secrets.py): the tests read back every byte of the run or sweep directory (Hydra's saved configs,
wandb's run file, DeepSpeed's checkpoints, submitit's pickles, the sweep report) and of the data cache.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from ds_exp.config.paths import conf_dir
from ds_exp.config.secrets import hide_secret_overrides
from ds_exp.core.errors import ConfigError
from tests.conftest import REPO, run_cli
from tests.system.test_slurm import _cluster_up
from tests.training import FAST, launch, multirun, report_rows
from tests.wandb_files import records

WANDB_KEY = "wandb-secret-4f1c9e0b7a"
HF_TOKEN = "hf_secret_token_9d2a61"
COMET_KEY = "comet-secret-key-73b0e5"

# Given on the command line: a schema key, an added key (issue 14's example: composes, nothing reads it),
# a key DeepSpeed's comet monitor reads, and a variable Hydra sets in the job's environment.
CLI_WANDB_KEY = "cli-wandb-key-5e8a21c4"
CLI_EXTRA_KEY = "cli-extra-key-a1b2c3d4"
CLI_COMET_KEY = "cli-comet-key-0b93d7f6"
CLI_ENV_SET_KEY = "cli-envset-key-77f0e1"
# names of other credential families (issue 21: these reached .hydra/, wandb and optuna's files in clear)
CLI_PAT = "cli-gh-pat-3c51f0a2"
CLI_AUTH = "cli-proxy-auth-9e04b7"
CLI_SECRETS = [
    f"logger.wandb.api_key={CLI_WANDB_KEY}",
    f"+logger.api_key={CLI_EXTRA_KEY}",
    f"+deepspeed.config.comet.api_key={CLI_COMET_KEY}",
    "+deepspeed.config.comet.enabled=false",
    f"+hydra.job.env_set.MY_SERVICE_API_KEY={CLI_ENV_SET_KEY}",
    f"+logger.gh_pat={CLI_PAT}",
    f"+logger.proxyAuth={CLI_AUTH}",
]
ENV_SECRETS = {"WANDB_API_KEY": WANDB_KEY, "HF_TOKEN": HF_TOKEN, "WANDB_MODE": "offline"}
ALL_SECRETS = [CLI_WANDB_KEY, CLI_EXTRA_KEY, CLI_COMET_KEY, CLI_ENV_SET_KEY, CLI_PAT, CLI_AUTH, WANDB_KEY, HF_TOKEN]
# from a config file (--config-dir DIR experiment=leaky) and from the environment through ${oc.env:...}
FILE_WANDB_KEY = "file-wandb-key-6d2e90"
FILE_SIGNATURE = "file-upload-sig-15c8aa"
ENV_DEPLOY_PAT = "env-deploy-pat-40b7e3"
LEAKY_EXPERIMENT = f"""# @package _global_
logger: {{wandb: {{api_key: {FILE_WANDB_KEY}}}}}
hydra: {{job: {{env_set: {{ACME_UPLOAD_SIGNATURE: {FILE_SIGNATURE}}}}}}}
"""
# the command line's secrets less logger.wandb.api_key, which the experiment file sets
BESIDE_THE_FILE = [s for s in CLI_SECRETS if not s.startswith("logger.wandb.api_key=")]

# issue 31 §4: secrets by shape under innocent keys (MLflow's tags reach wandb and TensorBoard with the config),
# by place (every hydra.job.env_set value), by compound name, and one holding `${`, taken literally
SHAPE_URL_PW = "cli-url-pw-81c2"
SHAPE_HOOK = "cliHook3e9d0a"
SHAPE_ACCOUNT_KEY = "cli-acct-key-6a0f"
PLACE_ENV_SET = "cli-envset-plain-5b7a"
NAME_APITOKEN = "cli-apitoken-0d1e"
LITERAL_DOLLAR = "cli-${x}-dollar-7c2d"
FILE_URL_PW = "file-url-pw-9d3b"
BY_SHAPE = [
    f"+logger.mlflow.tags.db=postgresql://bob:{SHAPE_URL_PW}@db.example.com/x",
    f"+logger.mlflow.tags.hook=https://hooks.slack.com/services/T000/B000/{SHAPE_HOOK}",
    f"+logger.mlflow.tags.conn=AccountName=acct;AccountKey={SHAPE_ACCOUNT_KEY};EndpointSuffix=core.windows.net",
    f"+hydra.job.env_set.UPLOAD_URL={PLACE_ENV_SET}",
    f"+logger.apitoken={NAME_APITOKEN}",
    f"+logger.literal_pat={LITERAL_DOLLAR}",
]
# issue 39 §2: token formats under innocent keys, found by detect-secrets' plugins or ds_exp's own patterns
TOKENS = {
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJjaS10ZXN0In0.c2lnbmF0dXJlLTRmOGIzYzFkOWUyYTdiNmM1ZDBl",
    "stripe": "sk_live_51Hx8dQ2eZvKYlo2Cq9e3Rt7u",
    "google": "ya29.a0AfH6SMBx3Kc9dBQ7kQeXm1JNdD0sVUvJ",
    "npm": "npm_Zq1w2e3r4t5y6u7i8o9p0aSdFgHjKlZxCvBnM1",
    "slack": "xapp-1-A0123456789-1234567890123-0f9e8d7c6b5a4f3e2d1c",
    "aws": "Kq7mN2pR9sT4vW8xY3zA6bC1dE5fG0hJ+/LoUiYt",
    "bearer": "0b7e3f1a9c2d4e5f6a7b8c9d0e1f",
}
BY_SHAPE += [f"+logger.mlflow.tags.{name}={value}" for name, value in TOKENS.items() if name != "bearer"]
BY_SHAPE += [f"+logger.mlflow.tags.auth='Authorization: Bearer {TOKENS['bearer']}'"]
SHAPE_SECRETS = [SHAPE_URL_PW, SHAPE_HOOK, SHAPE_ACCOUNT_KEY, PLACE_ENV_SET, NAME_APITOKEN, LITERAL_DOLLAR]
SHAPE_SECRETS += [*TOKENS.values(), FILE_URL_PW]
# ... and one by its shape, in a block DeepSpeed logs whole at start-up (its comet monitor's settings)
LEAKY_SHAPES = f"deepspeed: {{config: {{comet: {{project: 'mysql://me:{FILE_URL_PW}@db.example/x'}}}}}}\n"


def leaky_config_dir(tmp_path: Path, extra: str = "") -> Path:
    """A --config-dir whose experiment=leaky writes credentials in clear."""
    config_dir = tmp_path / "my_conf"
    (config_dir / "experiment").mkdir(parents=True)
    (config_dir / "experiment" / "leaky.yaml").write_text(LEAKY_EXPERIMENT + extra)
    return config_dir


def files_holding(root: Path, needles: list[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits = [n for n in needles if n.encode() in data]
            if hits:
                found[str(path)] = hits
    return found


@pytest.mark.slow
def test_secrets_never_appear_in_configs_logs_or_wandb(tmp_path):
    ds_file = tmp_path / "ds.json"
    # DeepSpeed's comet monitor takes an api_key; DeepSpeed logs its whole config at start-up
    ds_file.write_text(json.dumps({"comet": {"enabled": False, "api_key": COMET_KEY}}))
    run = launch(
        tmp_path / "run",
        *FAST,
        "train.export=true",
        "logger=wandb",
        "logger.wandb.mode=offline",
        f"deepspeed.config_file={ds_file}",
        env={"WANDB_API_KEY": WANDB_KEY, "HF_TOKEN": HF_TOKEN, "WANDB_MODE": "offline"},
    )
    assert run.ok, run.explain()
    assert list((run.run_dir / "wandb").glob("offline-run-*")), "no wandb offline run was written"
    secrets = [WANDB_KEY, HF_TOKEN, COMET_KEY]
    assert files_holding(run.run_dir, secrets) == {}
    assert not [s for s in secrets if s in run.proc.stdout + run.proc.stderr]
    # the keys are still there, blanked, and DeepSpeed's logged config was blanked rather than dropped
    assert json.loads((run.run_dir / "ds_config.json").read_text())["comet"]["api_key"] == "<redacted>"
    assert "<redacted>" in (run.run_dir / "logs" / "rank0.log").read_text()


@pytest.mark.slow
def test_caches_hold_no_pickle_and_exports_are_safetensors(tmp_path):
    cache = tmp_path / "cache"
    run = launch(tmp_path / "run", *FAST, "train.export=true", "train.save_final_checkpoint=true", cache_dir=cache)
    assert run.ok, run.explain()
    cached = [p for p in cache.rglob("*") if p.is_file()]
    assert cached and {p.suffix for p in cached} <= {".arrow", ".json", ".lock"}, sorted(map(str, cached))
    exported = {p.suffix for p in (run.run_dir / "hf_model").iterdir()}
    assert ".safetensors" in exported and not exported & {".bin", ".pt", ".pth", ".pkl"}, exported


class _Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path):
    run = launch(tmp_path / "run", *FAST, "train.save_final_checkpoint=true")
    assert run.ok, run.explain()
    tag_dir = run.run_dir / "checkpoints" / "step8"
    states = next(tag_dir.glob("*model_states.pt"))
    marker = tmp_path / "marker"
    with states.open("wb") as fh:
        pickle.dump({"module": _Payload(marker)}, fh)

    resumed = launch(run.run_dir, *FAST, "train.max_steps=12", "resume=auto")
    assert resumed.proc.returncode == 2, resumed.explain()
    assert not marker.exists(), "the checkpoint's pickle ran code"
    assert "resume only from checkpoints you trust" in resumed.proc.stderr
    assert "Traceback" not in resumed.proc.stderr


# ---------------------------------------------------------------- secrets on the command line

HIDDEN = [
    # (override as typed, as Hydra gets it, the value in the environment)
    ("+logger.api_key=sk-abc123", "+logger.api_key=${oc.env:DS_EXP_SECRET_LOGGER_API_KEY}", "sk-abc123"),
    # quoted as Hydra reads it: the quotes go, the comma and "=" stay
    (
        "logger.wandb.api_key='a b,c=d'",
        "logger.wandb.api_key=${oc.env:DS_EXP_SECRET_LOGGER_WANDB_API_KEY}",
        "a b,c=d",
    ),
    # a base64 key ending in "=" that Hydra's grammar rejects: taken as typed
    ("++model.hf_token=hf/ab+cd==", "++model.hf_token=${oc.env:DS_EXP_SECRET_MODEL_HF_TOKEN}", "hf/ab+cd=="),
    # a number to Hydra: kept as typed
    ("+data.password=1e10", "+data.password=${oc.env:DS_EXP_SECRET_DATA_PASSWORD}", "1e10"),
    (
        "+hydra.job.env_set.WANDB_API_KEY=k-123456",
        "+hydra.job.env_set.WANDB_API_KEY=${oc.env:DS_EXP_SECRET_HYDRA_JOB_ENV_SET_WANDB_API_KEY}",
        "k-123456",
    ),
    # issue 21: these were written in clear (the old list knew api_key, token, password, credential)
    ("+logger.private_key=pk-0001", "+logger.private_key=${oc.env:DS_EXP_SECRET_LOGGER_PRIVATE_KEY}", "pk-0001"),
    ("+logger.wandb_key=wk-0002", "+logger.wandb_key=${oc.env:DS_EXP_SECRET_LOGGER_WANDB_KEY}", "wk-0002"),
    ("+logger.auth=au-0003", "+logger.auth=${oc.env:DS_EXP_SECRET_LOGGER_AUTH}", "au-0003"),
    ("+logger.pat=pa-0004", "+logger.pat=${oc.env:DS_EXP_SECRET_LOGGER_PAT}", "pa-0004"),
]
UNCHANGED = [
    "zero=stage2",
    "hydra/launcher=local",
    "data.end_of_conversation_token=<eot>",  # mentions a token, holds none
    "eval.max_new_tokens=16",
    "+scheduler.patience=3",
    "+hub.private=true",  # a flag: credential-named, but no secret
    "~logger.api_key",
    "logger.wandb.api_key=null",
    "logger.wandb.api_key=${oc.env:MY_WANDB_KEY}",  # already an interpolation
    "--cfg",
    "job",
    "-m",
]
REFUSED = [
    ("+logger.api_key=k-one-secret,k-two-secret", "a sweep over a secret is not supported"),
    ("~logger.api_key=k-one-secret", "delete a secret without its value"),
    ("+deepspeed.config.comet={enabled:true,api_key:k-one-secret}", "holds a secret inside its value"),
    ("+model.credentials=[k-one-secret]", "a secret must be a single value"),
    ("hydra.launcher.additional_parameters.password=k-one-secret", "Hydra writes its settings into files"),
]


# ---------------------------------------------------------------- which names are credentials

# Names none of which is spelt out in ds_exp/secret_names.py: its word families and rules must find them.
CREDENTIAL_NAMES = [
    "openai_key", "SLACK_BOT_TOKEN", "mlflowTrackingPassword", "gh_pat", "proxyAuth", "deploy_private",
    "smtp_pass", "sentry_dsn", "ws_cookie", "x_api_signature", "db_pwd", "stripesecret", "myApiKey",
    "zzz_credentials", "twilio_auth_token", "AZURE_STORAGE_ACCOUNT_KEY", "session_id", "rabbit_passwd",
    "oauthClientSecret", "S3_SECRET_ACCESS_KEY", "hf_hub_token2", "key", "token", "bearer",
]  # fmt: skip
INNOCENT_NAMES = [
    "patience", "path", "pattern", "author", "tokenizer", "max_new_tokens", "pad_token_id",
    "end_of_conversation_token", "num_key_value_heads", "exclude_keys", "keyboard_layout", "monkey_patch",
    "passage_field", "compass_heading", "tokens_per_s", "author_email", "patch_size", "password_file",
    "auth_type", "session_name", "secret_name", "api_key_env", "SSH_AUTH_SOCK", "PWD", "OLDPWD",
    "DESKTOP_SESSION", "XDG_SESSION_TYPE", "first_pass", "sort_key", "bos_token", "token_count", "pathway",
    "authority", "TOKENIZERS_PARALLELISM", "keepalive", "passthrough", "spatial", "privacy_policy_url",
]  # fmt: skip


def test_credential_names_are_found_by_their_family_not_by_a_list():
    from ds_exp.config.secret_names import is_secret_name

    assert [name for name in CREDENTIAL_NAMES if not is_secret_name(name)] == []
    assert [name for name in INNOCENT_NAMES if is_secret_name(name)] == []


def test_no_setting_of_ds_exp_or_hydra_is_taken_for_a_credential():
    """Every key of every config file in conf/ and of the composed config (Hydra's own included): only
    logger.wandb.api_key is a credential, so no setting is hidden or refused as one."""
    import yaml
    from omegaconf import OmegaConf

    from ds_exp.config.secret_names import is_secret_name

    keys: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            keys.update(map(str, node))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in conf_dir().rglob("*.yaml"):
        walk(yaml.safe_load(path.read_text()))
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        walk(OmegaConf.to_container(compose(config_name="config", return_hydra_config=True), resolve=False))
    assert len(keys) > 200 and {key for key in keys if is_secret_name(key)} == {"api_key"}


@pytest.fixture
def restored_environ():
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_config_files_credentials_become_interpolations_before_hydra_saves_anything(tmp_path, restored_environ):
    """An experiment file (as --config-dir DIR experiment=NAME finds it) with literal credentials: the composed
    config, which Hydra writes to .hydra/*.yaml and `--cfg job` prints, holds interpolations; the run resolves
    the values; a flag named like a credential stays a flag."""
    import os

    from omegaconf import OmegaConf

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "leaky.yaml").write_text(
        "# @package _global_\n"
        "logger: {wandb: {api_key: file-wandb-key-31ab}}\n"
        "deepspeed: {config: {comet: {enabled: false, api_key: file-comet-key-82cd, experiment_key: exp-1234567},\n"
        "  acme.io: {upload: {bearer: [file-bearer-0a1b2c]}}}}\n"  # a key with a dot; a list under a credential
        "hydra: {job: {env_set: {ACME_UPLOAD_SIGNATURE: file-envset-sig-77ef}}}\n"
    )
    overrides = [f"hydra.searchpath=[file://{tmp_path}]", "experiment=leaky", "+hub.private=true"]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    saved = OmegaConf.to_yaml(cfg)
    assert "file-" not in saved, saved
    assert "api_key: ${oc.env:DS_EXP_SECRET_FILE_LOGGER_WANDB_API_KEY}" in saved
    assert cfg.logger.wandb.api_key == "file-wandb-key-31ab"
    assert cfg.deepspeed.config.comet.api_key == "file-comet-key-82cd"
    assert cfg.deepspeed.config["acme.io"].upload.bearer == ["file-bearer-0a1b2c"]
    assert cfg.deepspeed.config.comet.experiment_key == "exp-1234567" and "exp-1234567" in saved  # no credential
    assert cfg.hydra.job.env_set.ACME_UPLOAD_SIGNATURE == "file-envset-sig-77ef"
    assert os.environ["DS_EXP_SECRET_FILE_DEEPSPEED_CONFIG_COMET_API_KEY"] == "file-comet-key-82cd"
    assert cfg.hub.private is True and cfg.deepspeed.config.comet.enabled is False


@pytest.mark.parametrize(("override", "rewritten", "value"), HIDDEN, ids=[h[0] for h in HIDDEN])
def test_a_secret_override_moves_into_the_environment(override, rewritten, value):
    environ: dict[str, str] = {}
    assert hide_secret_overrides([override], environ) == [rewritten]
    assert environ == {rewritten.split("${oc.env:")[1].rstrip("}"): value}


def test_other_arguments_are_left_alone():
    environ: dict[str, str] = {}
    assert hide_secret_overrides(UNCHANGED, environ) == UNCHANGED
    assert environ == {}


@pytest.mark.parametrize(("override", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_secret_override_that_would_be_written_is_refused_without_showing_it(override, message):
    environ: dict[str, str] = {}
    with pytest.raises(ConfigError) as err:
        hide_secret_overrides(["zero=stage2", override], environ)
    assert message in str(err.value) and "k-one-secret" not in str(err.value)
    assert environ == {}


def test_a_hidden_secret_resolves_to_its_value_in_the_composed_config(monkeypatch):
    environ: dict[str, str] = {}
    overrides = hide_secret_overrides(["logger=wandb", *CLI_SECRETS], environ)
    assert not [s for s in ALL_SECRETS if s in " ".join(overrides)]
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    assert cfg.logger.wandb.api_key == CLI_WANDB_KEY
    assert cfg.logger.api_key == CLI_EXTRA_KEY
    assert cfg.deepspeed.config.comet.api_key == CLI_COMET_KEY
    assert cfg.hydra.job.env_set.MY_SERVICE_API_KEY == CLI_ENV_SET_KEY


CFG_JOB = """
import sys
sys.argv = ["ds_exp", "--cfg", "job", "+logger.api_key={secret}"]
from ds_exp.launch.cli import main
try:
    main()
except SystemExit:
    pass
print("HEAVY:", sorted(m for m in ("torch", "deepspeed", "transformers", "datasets") if m in sys.modules))
"""


def test_cfg_job_shows_the_interpolation_and_stays_light(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", CFG_JOB.format(secret=CLI_EXTRA_KEY)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert "api_key: ${oc.env:DS_EXP_SECRET_LOGGER_API_KEY}" in result.stdout, result.stdout + result.stderr
    assert CLI_EXTRA_KEY not in result.stdout + result.stderr
    assert "HEAVY: []" in result.stdout


def test_a_refused_secret_override_stops_before_hydra(tmp_path):
    result = run_cli("-m", "+logger.api_key=k-one-secret,k-two-secret", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "ds_exp: error: +logger.api_key=...: a sweep over a secret is not supported" in result.stderr
    assert "k-one-secret" not in result.stdout + result.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_command_line_config_file_and_environment_secrets_reach_no_file(tmp_path):
    """Secrets by name, by shape and by place, from the command line, a config file and the environment: none in
    any file of the run (.hydra/, logs, summary, metrics, checkpoints, wandb's offline run, TensorBoard's events)
    or on the console. MLflow's tags and params: tests/integration/test_trackers.py (in-process: MLflow's store
    costs 15 s here); that such a run, started with `+key=` additions, continues with resume=auto:
    tests/unit/test_secrets.py."""
    cache = tmp_path / "cache"
    secrets = [*ALL_SECRETS, FILE_WANDB_KEY, FILE_SIGNATURE, ENV_DEPLOY_PAT, *SHAPE_SECRETS]
    env = {**ENV_SECRETS, "ACME_DEPLOY_PAT": ENV_DEPLOY_PAT}
    common = ["--config-dir", str(leaky_config_dir(tmp_path, LEAKY_SHAPES)), "experiment=leaky", *FAST]
    run = launch(
        tmp_path / "run",
        *common,
        "train.export=true",
        "train.save_final_checkpoint=true",
        "logger=[wandb,tensorboard]",
        "logger.wandb.mode=offline",
        *BESIDE_THE_FILE,
        *BY_SHAPE,
        "+logger.notes=${oc.env:ACME_DEPLOY_PAT}",  # an environment secret under an innocent key
        cache_dir=cache,
        env=env,
    )
    # completed: every ${oc.env:...} resolved (without a default, a missing variable fails the run)
    assert run.ok, run.explain()
    assert list((run.run_dir / "checkpoints").rglob("*model_states.pt")), "no DeepSpeed checkpoint was written"
    run_file = next((run.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert list((run.run_dir / "tensorboard").glob("events.*"))
    assert files_holding(run.run_dir, secrets) == {}
    assert files_holding(cache, secrets) == {}
    assert not [s for s in secrets if s in run.proc.stdout + run.proc.stderr]
    hydra_config = (run.run_dir / ".hydra" / "hydra.yaml").read_text()
    assert "ACME_UPLOAD_SIGNATURE: ${oc.env:DS_EXP_SECRET_FILE_HYDRA_JOB_ENV_SET_ACME_UPLOAD_SIGNATURE}" in hydra_config
    assert "UPLOAD_URL: ${oc.env:DS_EXP_SECRET_HYDRA_JOB_ENV_SET_UPLOAD_URL}" in hydra_config
    job_config = (run.run_dir / ".hydra" / "config.yaml").read_text()
    assert "api_key: ${oc.env:DS_EXP_SECRET_FILE_LOGGER_WANDB_API_KEY}" in job_config
    # a secret by its shape keeps the rest of its value readable: the user, the host, the fields
    assert "db: postgresql://bob:${oc.env:DS_EXP_SECRET_LOGGER_MLFLOW_TAGS_DB}@db.example.com/x" in job_config
    assert "project: mysql://me:${oc.env:DS_EXP_SECRET_FILE_DEEPSPEED_CONFIG_COMET_PROJECT}@db.example/x" in job_config
    # Hydra saved, and wandb recorded as the program's arguments, the interpolation
    overrides = (run.run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "+logger.api_key=${oc.env:DS_EXP_SECRET_LOGGER_API_KEY}" in overrides
    args = [list(r.environment.args) for r in records(run_file) if r.WhichOneof("record_type") == "environment"]
    assert args and "+logger.api_key=${oc.env:DS_EXP_SECRET_LOGGER_API_KEY}" in args[0], args
    # DeepSpeed's comet monitor got the key: its logged config shows it blanked, not missing; and the project's
    # URL with its password blanked, the rest as it was
    rank0 = (run.run_dir / "logs" / "rank0.log").read_text()
    assert "api_key='<redacted>'" in rank0 and "project='mysql://me:<redacted>@db.example/x'" in rank0


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_a_sweep_writes_no_secret_into_its_directory(tmp_path, launcher):
    """submitit's pickles hold the interpolations; its local executor and sbatch hand the job the environment.
    The job composes its own config (and saves its .hydra/): a config file's credentials are hidden there too."""
    if launcher == "slurm" and not _cluster_up():
        pytest.skip("no SLURM cluster running (launchers/slurm_cluster.sh start)")
    sweep, cache = tmp_path / "sweep", tmp_path / "cache"
    proc = multirun(
        tmp_path,
        sweep,
        "--config-dir",
        str(leaky_config_dir(tmp_path)),
        "experiment=leaky",
        f"hydra/launcher={launcher}",
        *FAST,
        "train.save_final_checkpoint=true",
        "logger=wandb",
        "logger.wandb.mode=offline",
        *BESIDE_THE_FILE,
        *BY_SHAPE,
        f"data.cache_dir={cache}",
        env=ENV_SECRETS,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert [row["status"] for row in report_rows(sweep)] == ["completed"]
    assert list(sweep.glob(".submitit/*/*.pkl")), "submitit left no pickles"
    assert list(sweep.glob("0/wandb/offline-run-*/run-*.wandb")), "no wandb offline run was written"
    assert list(sweep.glob("0/checkpoints/*/*model_states.pt")), "no DeepSpeed checkpoint was written"
    secrets = [*ALL_SECRETS, FILE_WANDB_KEY, FILE_SIGNATURE, *SHAPE_SECRETS[:-1]]  # the file's shapes are not used
    assert files_holding(sweep, secrets) == {}
    assert files_holding(cache, secrets) == {}
    assert not [s for s in secrets if s in proc.stdout + proc.stderr]
    assert "api_key='<redacted>'" in (sweep / "0" / "logs" / "rank0.log").read_text()
    assert "DS_EXP_SECRET_FILE_LOGGER_WANDB_API_KEY" in (sweep / "0" / ".hydra" / "config.yaml").read_text()
