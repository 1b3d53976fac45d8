"""Secrets never land in what a run writes; caches hold no pickle; exports are safetensors; a resume never
unpickles arbitrary objects (torch.load with weights_only=True on checkpoint files from an earlier process)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from tests.training import FAST, launch

pytestmark = pytest.mark.slow

WANDB_KEY = "wandb-secret-4f1c9e0b7a"
HF_TOKEN = "hf_secret_token_9d2a61"
COMET_KEY = "comet-secret-key-73b0e5"


def files_holding(root: Path, needles: list[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits = [n for n in needles if n.encode() in data]
            if hits:
                found[str(path)] = hits
    return found


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
