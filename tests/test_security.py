"""Secrets never land in what a run writes; caches hold no pickle; exports are safetensors; a resume never
unpickles arbitrary objects (torch.load with weights_only=True on checkpoint files from an earlier process).

Secrets given on the command line move into DS_EXP_SECRET_* environment variables before Hydra parses it
(ds_exp/secrets.py): the tests read back every byte of the run or sweep directory (Hydra's saved configs,
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
from ds_exp.errors import ConfigError
from tests.conftest import REPO, run_cli
from tests.test_slurm import _cluster_up
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
CLI_SECRETS = [
    f"logger.wandb.api_key={CLI_WANDB_KEY}",
    f"+logger.api_key={CLI_EXTRA_KEY}",
    f"+deepspeed.config.comet.api_key={CLI_COMET_KEY}",
    "+deepspeed.config.comet.enabled=false",
    f"+hydra.job.env_set.MY_SERVICE_API_KEY={CLI_ENV_SET_KEY}",
]
ENV_SECRETS = {"WANDB_API_KEY": WANDB_KEY, "HF_TOKEN": HF_TOKEN, "WANDB_MODE": "offline"}
ALL_SECRETS = [CLI_WANDB_KEY, CLI_EXTRA_KEY, CLI_COMET_KEY, CLI_ENV_SET_KEY, WANDB_KEY, HF_TOKEN]


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
]
UNCHANGED = [
    "zero=stage2",
    "hydra/launcher=local",
    "data.end_of_conversation_token=<eot>",  # mentions a token, holds none
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
def test_command_line_and_environment_secrets_reach_no_file(tmp_path):
    cache = tmp_path / "cache"
    run = launch(
        tmp_path / "run",
        *FAST,
        "train.export=true",
        "train.save_final_checkpoint=true",
        "logger=wandb",
        "logger.wandb.mode=offline",
        *CLI_SECRETS,
        cache_dir=cache,
        env=ENV_SECRETS,
    )
    # completed: every ${oc.env:...} resolved (without a default, a missing variable fails the run)
    assert run.ok, run.explain()
    assert list((run.run_dir / "checkpoints").rglob("*model_states.pt")), "no DeepSpeed checkpoint was written"
    run_file = next((run.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files_holding(run.run_dir, ALL_SECRETS) == {}
    assert files_holding(cache, ALL_SECRETS) == {}
    assert not [s for s in ALL_SECRETS if s in run.proc.stdout + run.proc.stderr]
    # Hydra saved, and wandb recorded as the program's arguments, the interpolation
    overrides = (run.run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "+logger.api_key=${oc.env:DS_EXP_SECRET_LOGGER_API_KEY}" in overrides
    args = [list(r.environment.args) for r in records(run_file) if r.WhichOneof("record_type") == "environment"]
    assert args and "+logger.api_key=${oc.env:DS_EXP_SECRET_LOGGER_API_KEY}" in args[0], args
    # DeepSpeed's comet monitor got the key: its logged config shows it blanked, not missing
    assert "api_key='<redacted>'" in (run.run_dir / "logs" / "rank0.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_a_sweep_writes_no_secret_into_its_directory(tmp_path, launcher):
    """submitit's pickles hold the interpolations; its local executor and sbatch hand the job the environment."""
    if launcher == "slurm" and not _cluster_up():
        pytest.skip("no SLURM cluster running (launchers/slurm_cluster.sh start)")
    sweep, cache = tmp_path / "sweep", tmp_path / "cache"
    proc = multirun(
        tmp_path,
        sweep,
        f"hydra/launcher={launcher}",
        *FAST,
        "train.save_final_checkpoint=true",
        "logger=wandb",
        "logger.wandb.mode=offline",
        *CLI_SECRETS,
        f"data.cache_dir={cache}",
        env=ENV_SECRETS,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert [row["status"] for row in report_rows(sweep)] == ["completed"]
    assert list(sweep.glob(".submitit/*/*.pkl")), "submitit left no pickles"
    assert list(sweep.glob("0/wandb/offline-run-*/run-*.wandb")), "no wandb offline run was written"
    assert list(sweep.glob("0/checkpoints/*/*model_states.pt")), "no DeepSpeed checkpoint was written"
    assert files_holding(sweep, ALL_SECRETS) == {}
    assert files_holding(cache, ALL_SECRETS) == {}
    assert not [s for s in ALL_SECRETS if s in proc.stdout + proc.stderr]
    assert "api_key='<redacted>'" in (sweep / "0" / "logs" / "rank0.log").read_text()
