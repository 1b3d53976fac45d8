"""Small things a first hour runs into, each one message before anything heavy (issue 22 §6): a hub id with no hub
to reach, hydra/launcher=slurm without SLURM's commands, an item of a list the data option does not have, and a
warmup-stable-decay schedule whose decay does not fit the run (derived from the run's steps unless given)."""

from __future__ import annotations

import os
import socket
import time

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from ds_exp.config.override_checks import check_list_items_when_composing
from ds_exp.config.paths import conf_dir
from ds_exp.config.plan import WSD_DECAY_FRACTION, warmup_steps
from ds_exp.core.errors import ConfigError
from ds_exp.launch import hub
from ds_exp.launch.validation import validate
from ds_exp.resume.trajectory import trajectory_of
from ds_exp.sweeps.callbacks import check_slurm_commands

# ------------------------------------------------------------------------------------------------ the hub


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """A hub address where nothing listens (connection refused at once), an empty cache, online mode."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "hub_cache"


def test_a_hub_id_with_no_hub_to_reach_is_one_message_at_once(no_hub, compose_cfg):
    cfg = compose_cfg("model.name_or_path=meta-llama/Llama-2-7b-hf")
    started = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        hub.check_hub(cfg.model, dry_run=cfg.dry_run)
    assert time.perf_counter() - started < hub.PROBE_TIMEOUT_S
    message = str(err.value)
    assert "model.name_or_path=meta-llama/Llama-2-7b-hf is a Hugging Face hub id" in message
    assert "hf download meta-llama/Llama-2-7b-hf --local-dir DIR" in message and str(no_hub) in message
    assert "HF_HUB_OFFLINE" not in os.environ


def test_a_cached_hub_id_loads_offline_when_the_hub_is_away(no_hub, compose_cfg, monkeypatch):
    snapshot = no_hub / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored after the test (check_hub sets it to 1)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.check_hub(compose_cfg("model.name_or_path=org/cached").model, dry_run=False)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # transformers then reads the cache without retrying


def test_offline_mode_refuses_an_uncached_hub_id_without_probing(no_hub, compose_cfg, monkeypatch, tmp_path):
    """A user's shell (issue 31 §10): the variable that is set is named, with the cache looked in and the fix."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "unreachable", lambda *a, **k: pytest.fail("probed the hub in offline mode"))
    with pytest.raises(ConfigError) as err:
        hub.check_hub(compose_cfg("model.tokenizer=org/tok").model, dry_run=False)
    assert "model.tokenizer=org/tok is a Hugging Face hub id, HF_HUB_OFFLINE=1 is set (the hub is not asked)" in str(
        err.value
    )
    assert f"not in the local cache ({no_hub}, from HF_HUB_CACHE)" in str(err.value)
    assert str(err.value).endswith("give model.tokenizer=DIR, or unset HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with pytest.raises(ConfigError) as err:
        hub.check_hub(compose_cfg("model.tokenizer=org/tok").model, dry_run=False)
    assert "HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 are set" in str(err.value)
    assert f"({tmp_path / 'hf_home' / 'hub'}, from HF_HOME)" in str(err.value)
    assert str(err.value).endswith("or unset HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE")


def test_a_reachable_hub_and_local_models_are_left_alone(no_hub, compose_cfg, monkeypatch, tmp_path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        hub.check_hub(compose_cfg("model.name_or_path=org/not-cached").model, dry_run=False)
    assert "HF_HUB_OFFLINE" not in os.environ
    monkeypatch.setattr(hub, "unreachable", lambda *a, **k: pytest.fail("probed the hub for a local model"))
    hub.check_hub(compose_cfg().model, dry_run=False)  # the tiny model: built here
    hub.check_hub(compose_cfg(f"model.name_or_path={tmp_path}").model, dry_run=False)  # a directory


# ------------------------------------------------------------------------------------------------ SLURM


def _hydra_config(*overrides: str):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def test_the_slurm_launcher_without_slurm_commands_is_one_message(tmp_path, monkeypatch):
    config = _hydra_config("hydra/launcher=slurm")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="sbatch and srun not found on this machine's PATH"):
        check_slurm_commands(config)
    for name in ("sbatch", "srun"):  # with SLURM's commands on PATH the sweep goes on
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    check_slurm_commands(config)
    monkeypatch.setenv("PATH", "")
    check_slurm_commands(_hydra_config("hydra/launcher=local"))  # the local launcher needs none


# ------------------------------------------------------------------------------------------------ list items


def test_a_list_item_the_data_option_lacks_is_one_message_with_the_fix():
    check_list_items_when_composing()
    with pytest.raises(ConfigCompositionException) as err:
        _hydra_config("experiment=dschat_step1", "data.sources.0.path=/data/x")
    assert "data=synthetic has no data.sources[0]" in str(err.value)
    assert "data=dschat_local data.sources.0.path=/data/x" in str(err.value)
    with pytest.raises(ConfigCompositionException, match=r"data.sources has 1 item, so there is no data.sources\[1\]"):
        _hydra_config("data=local", "data.sources.1.path=/data/x")
    cfg = _hydra_config("experiment=dschat_step1", "data=dschat_local", "data.sources.0.path=/data/x")
    assert cfg.data.sources[0].path == "/data/x"


# ------------------------------------------------------------------------------------------------ WSD


def test_warmup_stable_decay_fits_its_decay_to_the_run(compose_cfg):
    """num_decay_steps was 100 whatever the run's length: at 40 steps the rate never reached optimizer.lr."""
    import torch  # the schedule transformers builds from what the run records (ds_exp.model.engine.lr_at's way)
    from transformers import get_scheduler

    for extra, warmup in (([], 0), (["scheduler.warmup_ratio=0.1"], 4)):
        cfg = compose_cfg("scheduler=warmup_stable_decay", "train.max_steps=40", *extra)
        assert warmup_steps(cfg.scheduler, 40) == warmup
        trajectory = trajectory_of(
            cfg.train, cfg.scheduler, cfg.optimizer.lr, total_steps=40, warmup_steps=warmup, world_size=1, data_key="d"
        )
        assert trajectory["scheduler_kwargs"]["num_decay_steps"] == round(40 * WSD_DECAY_FRACTION)
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        schedule = get_scheduler(
            "warmup_stable_decay",
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=40,
            scheduler_specific_kwargs=trajectory["scheduler_kwargs"],
        )
        rates = [schedule.lr_lambdas[0](step) for step in range(40)]
        assert rates[warmup:32] == [1.0] * (32 - warmup)  # the stable phase at the peak
        assert rates[-1] < 0.2  # then the decay


def test_a_decay_longer_than_the_run_is_refused(compose_cfg):
    cfg = compose_cfg("scheduler=warmup_stable_decay", "train.max_steps=40", "scheduler.kwargs.num_decay_steps=100")
    with pytest.raises(ConfigError, match="num_decay_steps=100 with 0 warmup steps does not fit in the run's 40"):
        validate(cfg, accelerator="cpu")
    by_epochs = compose_cfg("scheduler=warmup_stable_decay", "scheduler.kwargs.num_decay_steps=100")
    validate(by_epochs, accelerator="cpu")  # the run's length is known once the data is: said at the run's start
    with pytest.raises(ConfigError, match="at most 40"):
        warmup_steps(by_epochs.scheduler, 40)
    warmup_steps(by_epochs.scheduler, 250)
