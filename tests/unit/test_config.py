"""Config system: every option composes and validates, "auto" is filled right, mismatches are all listed,
DeepSpeed-Chat's DeepSpeed config is reproduced, user JSON files resolve."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import math
from pathlib import Path

import pytest

from ds_exp.config.ds_config import RunFacts, find_auto, resolve_ds_config
from ds_exp.config.paths import conf_dir
from ds_exp.core.errors import ConfigError
from ds_exp.launch.validation import validate

GROUPS = ["zero", "precision", "offload", "lora", "model", "data", "optimizer", "scheduler", "train", "dist", "logger"]

# What an option needs beside it to be a valid run on this CPU machine.
COMPANIONS = {
    ("offload", "cpu"): ["zero=stage2"],
    ("offload", "cpu_all"): ["zero=stage3"],
    ("offload", "nvme"): ["zero=stage3", "offload.nvme_path=/tmp"],
    # online (its default) would ask wandb's server before the run: tests talk to no server but 127.0.0.1
    ("logger", "wandb"): ["logger.wandb.mode=offline"],
}
ACCELERATOR = {("precision", "fp16"): "cuda", ("optimizer", "adamw_8bit"): "cuda"}
# bitsandbytes is no dependency of ds_exp: without it optimizer=adamw_8bit is refused (tests/unit/test_optimizers.py)
EXPECTED_INVALID: set[tuple[str, str]] = (
    set() if importlib.util.find_spec("bitsandbytes") else {("optimizer", "adamw_8bit")}
)


def all_options() -> list[tuple[str, str]]:
    """Every option of every group; the model presets compose, validate and are planned in test_model_presets.py."""
    groups = [g for g in [*GROUPS, "experiment"] if g != "model"]
    return [(g, p.stem) for g in groups for p in sorted((conf_dir() / g).glob("*.yaml"))]


@pytest.mark.parametrize(("group", "option"), all_options(), ids=lambda v: str(v))
def test_every_option_composes_and_validates(compose_cfg, group, option, tmp_path):
    if group == "data" and option != "synthetic":  # mandatory paths (???): they do not compose to a typed config
        pytest.skip("local data options point at user files; covered by the data tests")
    cfg = compose_cfg(f"{group}={option}", *COMPANIONS.get((group, option), []))  # typed: every interpolation resolved
    assert getattr(cfg, group if group != "experiment" else "experiment_name") is not None
    if (group, option) in EXPECTED_INVALID:
        with pytest.raises(ConfigError):
            validate(cfg, accelerator="cpu")
        return
    accelerator = ACCELERATOR.get((group, option), "cpu")
    if group == "experiment" and option == "dschat_step1":
        accelerator = "cuda"  # DeepSpeed-Chat trains in fp16
    validate(cfg, accelerator=accelerator)


def test_every_group_has_a_comment_on_every_knob():
    for path in conf_dir().rglob("*.yaml"):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if not stripped or stripped.startswith(("#", "-", "defaults")) or stripped.endswith(":"):
                continue
            if path.parent.name in ("experiment", "hydra_logging", "job_logging") or path.name == "config.yaml":
                continue  # presets, the root and Python's logging schema document their blocks, not each key
            identity = line.startswith(("name:", "stage:", "dtype:"))  # what the file's header comment describes
            assert "#" in line or identity or line.startswith("  "), f"{path}: no comment on `{stripped}`"


def _hf_style_file(tmp_path: Path, **overrides) -> str:
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_auto_table_is_filled_from_settings_and_run_facts(compose_cfg, tmp_path):
    cfg = compose_cfg(
        f"deepspeed.config_file={_hf_style_file(tmp_path)}",
        "train.micro_batch_size=4",
        "train.gradient_accumulation_steps=2",
        "train.gradient_clipping=0.5",
        "optimizer.lr=3e-4",
        "optimizer.betas=[0.8,0.9]",
        "optimizer.eps=1e-6",
        "optimizer.weight_decay=0.1",
        "scheduler.warmup_steps=7",
        "precision=bf16",
    )
    facts = RunFacts(world_size=4, hidden_size=1024, total_steps=500, precision="bf16", run_dir=str(tmp_path))
    ds = resolve_ds_config(cfg, facts)
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 4 * 2 * 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1}
    assert ds["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 7,
        "total_num_steps": 500,
    }
    assert ds["fp16"]["enabled"] is False and ds["bf16"]["enabled"] is True
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3  # the file wins for DeepSpeed-only keys: the default group is stage 0
    assert zero["reduce_bucket_size"] == 1024 * 1024
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 1024 * 1024)
    assert zero["stage3_param_persistence_threshold"] == 10 * 1024
    assert zero["stage3_max_live_parameters"] == 1e9
    assert ds["steps_per_print"] == 2000  # file wins
    assert find_auto(ds) == []


def test_a_file_that_brings_its_own_optimizer_and_scheduler_says_so(compose_cfg, tmp_path):
    from ds_exp.config.ds_config import replaced_by_config_file

    cfg = compose_cfg(f"deepspeed.config_file={_hf_style_file(tmp_path)}", "scheduler.warmup_steps=5")
    facts = RunFacts(world_size=1, hidden_size=64, total_steps=50, precision="fp32", run_dir=str(tmp_path))
    optimizer, scheduler = replaced_by_config_file(cfg.deepspeed.config_file, cfg.optimizer, cfg.scheduler, 50)
    assert "brings its own optimizer (AdamW)" in optimizer and "optimizer.impl=auto" in optimizer
    assert "brings its own scheduler (WarmupDecayLR): it replaces ds_exp's cosine schedule" in scheduler
    assert "(5 steps)" in scheduler
    # and the warmup it runs is ds_exp's own setting
    assert resolve_ds_config(cfg, facts)["scheduler"]["params"]["warmup_num_steps"] == 5
    assert replaced_by_config_file(None, cfg.optimizer, cfg.scheduler, 50) == []


def test_warmup_ratio_uses_total_steps(compose_cfg):
    cfg = compose_cfg("scheduler=linear", "scheduler.owner=deepspeed", "scheduler.warmup_ratio=0.1")
    ds = resolve_ds_config(cfg, RunFacts(world_size=1, hidden_size=64, total_steps=95, precision="fp32", run_dir="/x"))
    assert ds["scheduler"] == {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": 95,
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 1e-3,
            "warmup_num_steps": 10,
            "warmup_type": "linear",
        },
    }


def test_every_mismatch_is_listed_at_once(compose_cfg, tmp_path):
    path = _hf_style_file(
        tmp_path,
        train_micro_batch_size_per_gpu=8,
        gradient_clipping=2.0,
        optimizer__params__lr=0.1,
        bf16__enabled=True,
    )
    cfg = compose_cfg(f"deepspeed.config_file={path}", "train.micro_batch_size=4", "precision=fp32")
    with pytest.raises(ConfigError) as err:
        resolve_ds_config(cfg, RunFacts(world_size=1, hidden_size=64, total_steps=10, precision="fp32", run_dir="/x"))
    text = str(err.value)
    for expected in (
        "train_micro_batch_size_per_gpu=8 but ds_exp uses 4 (from train.micro_batch_size)",
        "gradient_clipping=2.0 but ds_exp uses 1.0",
        "optimizer.params.lr=0.1 but ds_exp uses 0.001 (from optimizer.lr)",
        "bf16.enabled=true but ds_exp uses false (from precision fp32)",
        '"auto"',
    ):
        assert expected in text
    assert len(err.value.problems) == 6  # header + 4 mismatches + the fix


def test_explicit_values_that_agree_are_accepted(compose_cfg, tmp_path):
    path = _hf_style_file(tmp_path, train_micro_batch_size_per_gpu=4, train_batch_size=8, optimizer__params__lr=1e-3)
    cfg = compose_cfg(f"deepspeed.config_file={path}", "train.micro_batch_size=4")
    ds = resolve_ds_config(cfg, RunFacts(world_size=2, hidden_size=64, total_steps=10, precision="fp32", run_dir="/x"))
    assert ds["train_batch_size"] == 8


def test_train_batch_size_that_cannot_hold_is_a_mismatch(compose_cfg):
    cfg = compose_cfg("train.global_batch_size=64", "train.micro_batch_size=4")
    # names the setting and the world size it holds at (issue 14), not a DeepSpeed file that was never given
    with pytest.raises(ConfigError, match=r"train.global_batch_size=64 holds only at world size 16 .* 4 rank"):
        resolve_ds_config(cfg, RunFacts(world_size=4, hidden_size=64, total_steps=10, precision="fp32", run_dir="/x"))


def test_missing_hidden_size_names_the_keys_to_set(compose_cfg):
    # ds_exp's own stage-3 defaults are numbers; "auto" (Hugging Face's hidden_size rule) is asked for here
    cfg = compose_cfg("zero=stage3", "zero.reduce_bucket_size=auto", "zero.stage3_prefetch_bucket_size=auto")
    with pytest.raises(ConfigError, match=r"reduce_bucket_size.*no hidden_size"):
        resolve_ds_config(cfg, RunFacts(world_size=1, hidden_size=None, total_steps=10, precision="fp32", run_dir="/x"))


def test_stage3_knobs_left_auto_are_dropped_below_stage3(compose_cfg):
    cfg = compose_cfg("zero=stage2", "+zero.stage3_prefetch_bucket_size=auto", "zero.reduce_bucket_size=auto")
    ds = resolve_ds_config(cfg, RunFacts(world_size=1, hidden_size=64, total_steps=10, precision="fp32", run_dir="/x"))
    assert "stage3_prefetch_bucket_size" not in ds["zero_optimization"]
    assert ds["zero_optimization"]["reduce_bucket_size"] == 64 * 64


# ---- DeepSpeed-Chat step 1 -------------------------------------------------------------------------------------
def dschat_get_train_ds_config(offload: bool, dtype: str, stage: int, global_batch: int, micro: int) -> dict:
    """DeepSpeed-Chat's utils/ds_utils.py get_train_ds_config (SFT: no hybrid engine, no tensorboard), with
    train_batch_size / micro batch overwritten from the options as its main.py does."""
    device = "cpu" if offload else "none"
    dtype_config = {"enabled": True, "loss_scale_window": 100} if dtype == "fp16" else {"enabled": True}
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "offload_param": {"device": device},
            "offload_optimizer": {"device": device},
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7,
            "memory_efficient_linear": False,
        },
        dtype: dtype_config,
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": False,
            "max_out_tokens": 512,
            "inference_tp_size": 1,
            "release_inference_cache": False,
            "pin_parameters": True,
            "tp_gather_partition_size": 8,
        },
    }


# Keys ds_exp writes that DeepSpeed-Chat leaves out, each at DeepSpeed's own default (no behaviour change).
DEEPSPEED_DEFAULTS = {
    "gradient_accumulation_steps": 1,
    "fp16.loss_scale": 0.0,
    "fp16.initial_scale_power": 16,
    "fp16.hysteresis": 2,
    "fp16.min_loss_scale": 1.0,
    "bf16.enabled": False,
    "csv_monitor.enabled": False,
    "csv_monitor.output_path": "/run/ds_monitor",
    "csv_monitor.job_name": "ds_monitor",
    "zero_optimization.offload_param.pin_memory": False,
    "zero_optimization.offload_optimizer.pin_memory": False,
}


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize(
    ("stage", "offload", "ours_offload"),
    [
        (0, False, "none"),
        (1, False, "none"),
        (2, False, "none"),
        (3, False, "none"),
        (2, True, "cpu"),
        (3, True, "cpu_all"),
    ],
)
def test_dschat_step1_gives_deepspeed_chats_config(compose_cfg, stage, offload, ours_offload):
    cfg = compose_cfg("experiment=dschat_step1", f"zero=stage{stage}", f"offload={ours_offload}")
    world = 8
    ours = resolve_ds_config(
        cfg, RunFacts(world_size=world, hidden_size=2048, total_steps=100, precision="fp16", run_dir="/run")
    )
    theirs = dschat_get_train_ds_config(offload, "fp16", stage, global_batch=16 * world, micro=16)
    flat_ours, flat_theirs = _flatten(ours), _flatten(theirs)
    for key, value in flat_theirs.items():
        if key == "zero_optimization.offload_param.device" and stage < 3:
            # DeepSpeed ignores parameter offload below stage 3; ds_exp refuses to write it there
            assert flat_ours[key] == "none"
            continue
        assert flat_ours.get(key) == value, key
    extras = {k: v for k, v in flat_ours.items() if k not in flat_theirs}
    assert extras == {k: v for k, v in DEEPSPEED_DEFAULTS.items() if k in extras}
    assert set(extras) <= set(DEEPSPEED_DEFAULTS)


def test_dschat_step1_options(compose_cfg):
    cfg = compose_cfg("experiment=dschat_step1")
    assert cfg.model.name_or_path == "facebook/opt-1.3b"
    assert cfg.data.data_split == "2,4,4" and cfg.data.max_seq_len == 512
    assert (cfg.train.micro_batch_size, cfg.train.seed, cfg.optimizer.lr) == (16, 1234, 1e-3)
    assert list(cfg.optimizer.betas) == [0.9, 0.95]
    assert cfg.lora.module_name == "decoder.layers." and cfg.lora.only_optimize is False
    assert cfg.scheduler.name.value == "cosine" and cfg.precision.dtype.value == "fp16"


def test_disable_dropout_zeroes_every_dropout_probability():
    from transformers import GPT2Config, OPTConfig

    from ds_exp.model.architecture import disable_dropout_in_config

    for config in (OPTConfig(dropout=0.1, attention_dropout=0.1), GPT2Config()):
        disable_dropout_in_config(config)
        probabilities = {k: v for k, v in config.to_dict().items() if "dropout" in k or k.endswith("pdrop")}
        assert probabilities and all(v == 0.0 for v in probabilities.values() if isinstance(v, float))


def test_hidden_size_rules():
    from types import SimpleNamespace

    from ds_exp.model.architecture import hidden_size_of

    assert hidden_size_of(SimpleNamespace(hidden_size=768)) == 768
    assert hidden_size_of(SimpleNamespace(hidden_sizes=[64, 128, 320])) == 320
    assert hidden_size_of(SimpleNamespace(text_config=SimpleNamespace(hidden_size=4096))) == 4096
    assert hidden_size_of(SimpleNamespace()) is None


# ----------------------------------------------------------------------------------------- model files (issue 14)

NO_TENSORS = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"  # a complete safetensors file that holds no tensor
LLAMA = {"model_type": "llama", "hidden_size": 64, "max_position_embeddings": 128, "rope_parameters": {}}


def _checkpoint(directory: Path, config: dict | str, weights: bytes | None = NO_TENSORS) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights is not None:
        (directory / "model.safetensors").write_bytes(weights)
    return directory


def _problems(cfg) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(cfg, accelerator="cpu")
    return info.value.problems


def test_an_nvme_path_that_is_a_file_is_refused(compose_cfg, tmp_path):
    (tmp_path / "nvme").write_text("x")
    expected = (
        f"offload.nvme_path={tmp_path / 'nvme'} is a file, not a directory; point offload.nvme_path at a directory on "
        "a local NVMe drive"
    )
    cfg = compose_cfg("zero=stage3", "offload=nvme", f"offload.nvme_path={tmp_path / 'nvme'}", "offload.param=nvme")
    assert _problems(cfg) == [expected]  # once, though optimizer and parameters both use it
    cfg = compose_cfg("zero=stage3", "offload=nvme", f"offload.nvme_path={tmp_path / 'nvme' / 'swap'}")
    assert _problems(cfg) == [
        f"offload.nvme_path={tmp_path / 'nvme' / 'swap'}: {tmp_path / 'nvme'} is a file, not a directory; point "
        "offload.nvme_path at a directory on a local NVMe drive"
    ]
    validate(compose_cfg("zero=stage3", "offload=nvme", f"offload.nvme_path={tmp_path / 'new'}"), accelerator="cpu")


def test_position_limits_read_from_a_config():
    from ds_exp.config.model_checks import position_limit

    assert position_limit({"model_type": "gpt2", "n_positions": 1024}) == ("n_positions", 1024, "learned")
    assert position_limit({"model_type": "opt", "max_position_embeddings": 2048}) == (
        "max_position_embeddings",
        2048,
        "learned",
    )
    assert position_limit({"model_type": "roberta", "max_position_embeddings": 514})[1] == 512  # padding offset
    assert position_limit({"model_type": "llama", "max_position_embeddings": 4096})[2] == "rope"
    assert position_limit({"model_type": "new_lm", "max_position_embeddings": 8, "rope_theta": 1e4})[2] == "rope"
    assert position_limit({"model_type": "new_lm", "max_position_embeddings": 8})[2] == "unknown"
    assert position_limit({"model_type": "bloom", "n_positions": 8}) is None  # ALiBi
    assert position_limit({"model_type": "falcon", "alibi": True, "max_position_embeddings": 8}) is None
    assert position_limit({"model_type": "llama"}) is None  # nothing said: transformers' default, unknown here
    nested = {"model_type": "llava", "text_config": {"model_type": "mistral", "max_position_embeddings": 32768}}
    assert position_limit(nested) == ("max_position_embeddings", 32768, "rope")


def test_max_seq_len_beyond_a_learned_position_table_is_an_error(compose_cfg, tmp_path):
    opt = _checkpoint(tmp_path / "opt", {"model_type": "opt", "hidden_size": 64, "max_position_embeddings": 128})
    cfg = compose_cfg("model=local", f"model.name_or_path={opt}", "data.max_seq_len=256")
    assert _problems(cfg) == [
        "data.max_seq_len=256 is beyond the model's 128 positions (opt, max_position_embeddings=128; it learned a "
        "table of absolute positions, longer inputs fail in the forward pass): set data.max_seq_len=128 or lower"
    ]
    validate(compose_cfg("model=local", f"model.name_or_path={opt}", "data.max_seq_len=128"), accelerator="cpu")
    gpt2 = ("model.arch.model_type=gpt2", "~model.arch.max_position_embeddings", "+model.arch.n_positions=64")
    gpt2 = compose_cfg(*gpt2, "data.max_seq_len=128")
    assert "data.max_seq_len=128 is beyond the model's 64 positions" in _problems(gpt2)[0]


def test_max_seq_len_beyond_a_rotary_context_is_a_warning(compose_cfg, tmp_path):
    from ds_exp.config.model_checks import max_seq_len_notes, max_seq_len_problems

    llama = _checkpoint(tmp_path / "llama", LLAMA)
    cfg = compose_cfg("model=local", f"model.name_or_path={llama}", "data.max_seq_len=256")
    validate(cfg, accelerator="cpu")
    assert max_seq_len_notes(cfg.model, cfg.data.max_seq_len) == [
        "data.max_seq_len=256 is beyond the model's trained context (max_position_embeddings=128): rotary position "
        "embeddings run past it, but quality usually drops there; set data.max_seq_len=128, or extend the context "
        "with model.rope_scaling={rope_type:yarn,factor:2.0,original_max_position_embeddings:128}"
    ]
    # the suggested override is accepted as typed, and silences the note; a factor too small says so
    scaled = compose_cfg(
        "model=local",
        f"model.name_or_path={llama}",
        "data.max_seq_len=256",
        "model.rope_scaling={rope_type:yarn,factor:2.0,original_max_position_embeddings:128}",
    )
    validate(scaled, accelerator="cpu")
    assert max_seq_len_notes(scaled.model, scaled.data.max_seq_len) == []
    short = compose_cfg(
        "model=local",
        f"model.name_or_path={llama}",
        "data.max_seq_len=1000",
        "model.rope_scaling={rope_type:linear,factor:4}",
    )
    assert max_seq_len_notes(short.model, short.data.max_seq_len) == [
        "data.max_seq_len=1000 is beyond the 512 positions model.rope_scaling={rope_type:linear,factor:4} stretches "
        "the trained context (max_position_embeddings=128) to; raise its factor to 8.0 or more"
    ]
    tiny = compose_cfg()  # the embedded default: llama, 512 positions
    validate(tiny, accelerator="cpu")
    assert (
        max_seq_len_notes(tiny.model, tiny.data.max_seq_len) == []
        and tiny.data.max_seq_len <= tiny.model.arch["max_position_embeddings"]
    )
    assert "(max_position_embeddings=512)" in max_seq_len_notes(tiny.model, 1024)[0]
    hub = compose_cfg("model=opt-1.3b", "data.max_seq_len=100000")  # a hub id: no local config.json to read
    assert (
        max_seq_len_problems(hub.model, hub.data.max_seq_len) == []
        and max_seq_len_notes(hub.model, hub.data.max_seq_len) == []
    )


def test_a_broken_config_json_is_reported_in_validation(compose_cfg, tmp_path):
    broken = _checkpoint(tmp_path / "broken", '{"model_type": "llama",\n  "hidden_size": 64,,\n}')
    assert _problems(compose_cfg("model=local", f"model.name_or_path={broken}")) == [
        f"model.name_or_path={broken}: config.json is not valid JSON (line 2 column 21: Expecting property name "
        "enclosed in double quotes); fix or replace the file"
    ]
    listed = _checkpoint(tmp_path / "list", "[1, 2]")
    assert _problems(compose_cfg("model=local", f"model.name_or_path={listed}")) == [
        f"model.name_or_path={listed}: config.json holds a JSON list, not an object; fix or replace the file"
    ]


def test_weights_that_are_missing_or_incomplete_are_refused_before_the_run(compose_cfg, tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    def problems(directory: Path, *extra: str) -> list[str]:
        cfg = compose_cfg("model=local", f"model.name_or_path={directory}", *extra)
        try:
            validate(cfg, accelerator="cpu")
        except ConfigError as err:
            return err.problems
        return []

    complete = _checkpoint(tmp_path / "complete", LLAMA, weights=None)
    save_file({"w": np.zeros((64, 64), dtype=np.float32)}, str(complete / "model.safetensors"))
    assert problems(complete) == []
    cut = _checkpoint(tmp_path / "cut", LLAMA, (complete / "model.safetensors").read_bytes()[:5000])
    size = (complete / "model.safetensors").stat().st_size
    assert problems(cut) == [
        f"model.name_or_path={cut}: model.safetensors is cut short (5000 of the {size} bytes its header lists); "
        "download or copy it again"
    ]
    lfs = _checkpoint(tmp_path / "lfs", LLAMA, b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")
    assert problems(lfs) == [
        f"model.name_or_path={lfs}: model.safetensors is a Git LFS pointer, not the weights; run `git lfs pull` in "
        "the checkpoint directory"
    ]
    none = _checkpoint(tmp_path / "none", LLAMA, weights=None)
    assert problems(none) == [
        f"model.name_or_path={none}: no weights file (model.safetensors, model.safetensors.index.json, "
        f"pytorch_model.bin, pytorch_model.bin.index.json) in {none}; copy the checkpoint's weights there (or use "
        "model.arch to train a model built from a config)"
    ]
    assert problems(none, "dry_run=true") == []  # a dry run plans from the config alone
    (none / "adapter_config.json").write_text("{}")
    assert "holds a PEFT adapter (adapter_config.json), not a whole model" in problems(none)[0]
    sharded = _checkpoint(tmp_path / "sharded", LLAMA, weights=None)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (sharded / "model-00001-of-00002.safetensors").write_bytes(NO_TENSORS)
    assert problems(sharded) == [
        f"model.name_or_path={sharded}: model-00002-of-00002.safetensors is missing (model.safetensors.index.json "
        "lists it); download or copy it again"
    ]


def test_checkpoint_errors_at_load_are_one_message(compose_cfg, tmp_path):
    """What validation cannot see without transformers (model_type, custom code), and weights that break after
    validation, are mapped where transformers loads them (ds_exp.model.checkpoint_error)."""
    import shutil

    from ds_exp.model.architecture import build_model_config
    from ds_exp.model.build import build_model
    from ds_exp.model.tokenizer import load_tokenizer

    embedded = str(conf_dir().parent / "ds_exp" / "assets" / "tokenizer")

    def load(directory: Path, *extra: str) -> str:
        cfg = compose_cfg("model=local", f"model.name_or_path={directory}", f"model.tokenizer={embedded}", *extra)
        validate(cfg, accelerator="cpu")
        tokenizer = load_tokenizer(cfg.model, cfg.data)
        with pytest.raises(ConfigError) as info:
            build_model(cfg, tokenizer, {"zero_optimization": {"stage": 0}})
        return str(info.value)

    unknown = _checkpoint(tmp_path / "unknown", {"model_type": "mystery_lm", "hidden_size": 64})
    assert load(unknown).startswith(f"model.name_or_path={unknown}: config.json has model_type=mystery_lm, which ")
    assert "does not know; upgrade transformers (pip install -U transformers)" in load(unknown)
    custom = _checkpoint(tmp_path / "custom", {"model_type": "mystery_lm", "auto_map": {"AutoConfig": "c.C"}})
    (custom / "c.py").write_text("raise SystemExit('ran code it was not allowed to run')\n")
    assert load(custom) == (
        f"model.name_or_path={custom}: the checkpoint ships its own model code (auto_map in config.json) for "
        "model_type=mystery_lm, which transformers does not have built in; model.trust_remote_code=true runs that "
        "code (only do so for a source you trust), or use a checkpoint of an architecture transformers knows"
    )
    # weights cut short after validation (a copy still running): from_pretrained's error, named by file
    good = tmp_path / "good"
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=512)
    LlamaForCausalLM(tiny).save_pretrained(good)
    cfg = compose_cfg("model=local", f"model.name_or_path={good}", f"model.tokenizer={embedded}")
    validate(cfg, accelerator="cpu")
    weights = good / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4000])
    with pytest.raises(ConfigError, match=r"model.safetensors is cut short \(4000 of the \d+ bytes"):
        build_model(cfg, load_tokenizer(cfg.model, cfg.data), {"zero_optimization": {"stage": 0}})
    # a config.json broken after validation is named as such by the tokenizer and config loaders too
    shutil.copytree(good, tmp_path / "later")
    (tmp_path / "later" / "config.json").write_text("{")
    cfg = compose_cfg("model=local", f"model.name_or_path={tmp_path / 'later'}")
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        load_tokenizer(cfg.model, cfg.data)
    base = compose_cfg()
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        build_model_config(cfg.model, load_tokenizer(base.model, base.data))


# What a model built from model.arch must hold (ds_exp/config/model_checks.py arch_problems), and numbers every run
# needs finite and in range: (changes to the default config, the start of the one line that refuses them). The
# config is composed once and changed in place (Hydra's compose takes most of a second).
ARCH_AND_NUMBERS = [
    ({"model.arch.hidden_size": 0}, "model.arch.hidden_size=0: must be a whole number > 0"),
    ({"model.arch.num_hidden_layers": -1}, "model.arch.num_hidden_layers=-1: must be a whole number > 0"),
    ({"model.arch.intermediate_size": 1.5}, "model.arch.intermediate_size=1.5: must be a whole number > 0"),
    ({"model.arch.hidden_size": "abc"}, "model.arch.hidden_size=abc: must be a whole number > 0"),
    ({"model.arch.num_key_value_heads": 1, "model.arch.num_attention_heads": 3}, "model.arch.hidden_size=128 is not"),
    ({"model.arch.num_key_value_heads": 3}, "model.arch.num_key_value_heads=3 does not divide model.arch.num_attent"),
    ({"model.arch.hidden_size": 12}, "model.arch: the attention head dimension hidden_size / num_attention_heads = 3"),
    ({"model.arch.rms_norm_eps": 0.0}, "model.arch.rms_norm_eps=0.0: must be > 0"),
    ({"model.arch.attention_dropout": 1.5}, "model.arch.attention_dropout=1.5: a probability, must be in [0, 1]"),
    ({"model.arch.model_type": None}, "model.arch.model_type is missing"),
    ({"dist.timeout_minutes": 2 * 10**15}, "dist.timeout_minutes=2000000000000000: must be from 1 to 525600 (a year;"),
    ({"dist.master_port": 99999}, "dist.master_port=99999: must be from 1 to 65535 (a TCP port"),
    ({"optimizer.weight_decay": 1e39}, "optimizer.weight_decay=1e+39: must be at most 3.403e+38, the largest float32"),
    ({"optimizer.lr": 3e38}, "optimizer.lr=3e+38: AdamW's first step lr / (1 - beta1) = 3e+39 is beyond the largest"),
    ({"optimizer.lr": 1e37, "optimizer.weight_decay": 100.0}, "optimizer.lr=1e+37: the weight decay factor lr x "),
    ({"optimizer.lr": math.nan}, "optimizer.lr=nan: must be a finite number"),
    (  # generation past a learned position table (OPT): each prompt is measured once the tokenizer is loaded
        {"model.arch.model_type": "opt", "eval.prompts": ["Hi"], "eval.max_new_tokens": 512},
        "eval.max_new_tokens=512 leaves no room for a prompt within the model's 512 positions (opt, max_position_emb",
    ),
    ({"train.peak_tflops": math.inf}, "train.peak_tflops=inf: must be a finite number"),
    ({"lora.dim": 4, "lora.alpha": math.inf}, "lora.alpha=inf: must be a finite number"),
]


def _changed(cfg, changes: dict):
    cfg = copy.deepcopy(cfg)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = functools.reduce(getattr, parents, cfg)
        if isinstance(node, dict):
            node[leaf] = value
        else:
            setattr(node, leaf, value)
    return cfg


def test_model_arch_and_numbers_are_checked_as_a_class(compose_cfg):
    base = compose_cfg()
    for changes, start in ARCH_AND_NUMBERS:
        problems = _problems(_changed(base, changes))
        assert len(problems) == 1 and problems[0].startswith(start), (changes, problems)
    # what stays allowed: a huge but representable rate (it diverges, and the run says so), an explicit head_dim
    allowed = (
        {"optimizer.lr": 1e30},
        {"model.arch.head_dim": 64, "model.arch.num_attention_heads": 3, "model.arch.num_key_value_heads": 1},
        {"dist.timeout_minutes": 525600},
        {"model.arch.model_type": "opt", "eval.max_new_tokens": 512},  # no prompt: nothing is generated
        {"eval.prompts": ["Hi"], "eval.max_new_tokens": 512},  # rotary (llama): it runs past its context
    )
    for changes in allowed:
        validate(_changed(base, changes), accelerator="cpu")


def test_checkpoints_and_export_never_overlap_nor_are_the_run_directory(compose_cfg, tmp_path):
    base = compose_cfg()
    refused = [
        ({"train.checkpoint_dir": "hf_model/ckpts"}, None, "train.checkpoint_dir=hf_model/ckpts is inside train.expo"),
        ({"train.export_dir": "checkpoints/hf"}, None, "train.export_dir=checkpoints/hf is inside train.checkpoint_d"),
        ({"train.export_dir": "checkpoints/."}, None, "train.checkpoint_dir=checkpoints and train.export_dir are the"),
        ({"train.checkpoint_dir": "."}, None, "train.checkpoint_dir=. is the run directory itself"),
        (
            {"train.export_dir": "x" * 300},
            None,
            "train.export_dir: the name xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...",
        ),
        # outside the run directory (allowed): placed by the run directory once it is known
        (
            {"train.allow_outside_run_dir": True, "train.export_dir": str(tmp_path / "run")},
            tmp_path / "run",
            f"train.export_dir={tmp_path / 'run'} is the run directory itself",
        ),
        (
            {"train.allow_outside_run_dir": True, "train.checkpoint_dir": str(tmp_path)},
            tmp_path / "run",
            f"train.checkpoint_dir={tmp_path} holds the run directory {tmp_path / 'run'}",
        ),
        (
            {"train.allow_outside_run_dir": True, "train.checkpoint_dir": str(tmp_path / "run" / "hf_model" / "c")},
            tmp_path / "run",
            f"train.checkpoint_dir={tmp_path / 'run' / 'hf_model' / 'c'} is inside train.export_dir",
        ),
    ]
    for changes, run_dir, start in refused:
        with pytest.raises(ConfigError) as info:
            validate(_changed(base, changes), accelerator="cpu", run_dir=run_dir)
        assert len(info.value.problems) == 1 and info.value.problems[0].startswith(start), (changes, info.value)
    allowed = {"train.allow_outside_run_dir": True, "train.checkpoint_dir": str(tmp_path / "ckpts")}
    validate(_changed(base, allowed), accelerator="cpu", run_dir=tmp_path / "run")
    validate(_changed(base, {"train.checkpoint_dir": "out/ckpts", "train.export_dir": "out/hf"}), accelerator="cpu")


def test_zero_and_offload_from_a_users_deepspeed_file_are_named_with_the_file_and_key(compose_cfg, tmp_path):
    base = compose_cfg()  # zero=stage0, offload=none

    def problems(ds: dict, **changes) -> list[str]:
        file = tmp_path / f"ds{len(list(tmp_path.iterdir()))}.json"
        file.write_text(json.dumps(ds))
        return _problems(_changed(base, {"deepspeed.config_file": str(file), **changes}))

    def key(path: str, value) -> str:
        return f'"zero_optimization.{path}": {json.dumps(value)} in deepspeed.config_file={tmp_path}'

    both = problems({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    assert both[0].startswith(key("offload_optimizer.device", "cpu"))
    assert both[0].endswith(
        'needs ZeRO stage 1, 2 or 3 (got stage 0 from "zero_optimization.stage" in the same file): set '
        '"zero_optimization.stage" to 1, 2 or 3 there, or remove "offload_optimizer" from it'
    )
    param = problems({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert param[0].startswith(key("offload_param.device", "cpu")) and "needs ZeRO stage 3 (got stage 2" in param[0]
    offload_only = problems({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})[0]
    assert (
        '(got stage 0 from zero=stage0): use zero=stage1 or higher, or remove "offload_optimizer" from' in offload_only
    )
    assert problems({"zero_optimization": {"stage": 7}})[0].startswith(key("stage", 7))
    nvme = problems({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})[0]
    assert nvme.startswith(key("offload_param.device", "nvme")) and 'add "nvme_path"' in nvme
    impl = problems(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, **{"optimizer.impl": "torch"}
    )
    assert len(impl) == 1 and impl[0].startswith(f"optimizer.impl=torch with {key('offload_optimizer.device', 'cpu')}")


def test_an_override_the_users_deepspeed_file_wins_over_is_named_and_tuning_is_not(tmp_path):
    """Issue 21: the file wins for DeepSpeed's own keys; an explicit override it silently beats is named (with the
    file), but the file tuning a knob of a chosen group (a bucket size under zero=stage1) is its normal use."""
    from hydra import compose, initialize_config_dir

    from ds_exp.config.ds_config import IgnoredOverride, check_overrides_obeyed
    from ds_exp.config.paths import conf_dir
    from ds_exp.config.schema import to_config

    def beaten(file: dict, *overrides: str) -> list[str]:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(file))
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            composed = compose(config_name="config", overrides=[*overrides, f"deepspeed.config_file={path}"])
        try:
            check_overrides_obeyed(composed, to_config(composed), list(overrides))
        except IgnoredOverride as err:
            return [line.split(" would not be used")[0] for line in err.problems]
        return []

    zero3 = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8}, "steps_per_print": 100}
    assert beaten(zero3, "zero=stage1", "zero.reduce_bucket_size=1000", "train.log_every=1") == [
        "zero=stage1",
        "zero.reduce_bucket_size=1000",
    ]
    assert beaten(zero3, "zero=stage3", "offload=none") == []  # what the file says too; not what it sets
    assert (
        beaten(
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"pin_memory": False}}},
            "zero=stage2",
            "offload=cpu",
        )
        == []
    )
    assert beaten({"zero_optimization": {"offload_optimizer": {"device": "none"}}}, "zero=stage1", "offload=cpu") == [
        "offload=cpu"
    ]
    assert beaten({"zero_optimization": {"stage": 1}}, "deepspeed.config.zero_optimization.stage=2") == [
        "deepspeed.config.zero_optimization.stage=2"
    ]
    blocks = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "scheduler": {"type": "WarmupLR", "params": {}}}
    assert beaten(blocks, "optimizer.lr=1e-4", "optimizer.eps=1e-7", "optimizer.impl=torch", "scheduler=linear") == [
        "optimizer.eps=1e-7",
        "optimizer.impl=torch",
        "scheduler=linear",
    ]
    assert beaten({}, "zero=stage1") == []


def test_composition_reads_a_config_file_again_once_it_is_edited_and_never_shares_it(tmp_path):
    """Each file is parsed once per process (ds_exp/core/compat/hydra.py cache_config_files): a notebook that edits a
    YAML between two runs gets the edit, and what one composition changes in its config no other composition sees."""
    import os
    import shutil

    from hydra import compose, initialize_config_dir

    from ds_exp.core.compat import hydra as hydra_compat

    conf = shutil.copytree(conf_dir(), tmp_path / "conf")
    lora = conf / "lora" / "default.yaml"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        first = compose(config_name="config")
        first.lora.dim = 123  # a caller's change to its own copy
        again = compose(config_name="config")
        lora.write_text(lora.read_text().replace(f"dim: {again.lora.dim}", "dim: 48", 1))
        os.utime(lora, ns=(lora.stat().st_atime_ns, lora.stat().st_mtime_ns + 1))  # even within the clock's tick
        edited = compose(config_name="config")
    assert any(str(conf) in key[1] for key in hydra_compat._PARSED)  # the files were cached, not read each time
    assert [key[2] for key in hydra_compat._PARSED if key[1] == str(conf) and "lora" in key[2]] == ["lora/default"]
    assert again.lora.dim not in (123, 48) and edited.lora.dim == 48
