"""The model presets (conf/model/*.yaml, issue 35 §10): every file composes and passes validation, and the dry run
plans its memory from the published architecture it carries, with no hub and no download. Parametrized over the
group's files: a preset added later is checked the same way (and must say its published parameter count here)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from ds_exp.config.model_checks import arch_problems
from ds_exp.config.paths import conf_dir
from ds_exp.core.errors import ConfigError
from ds_exp.launch.hub import check_hub, plans_from_arch
from ds_exp.launch.validation import validate
from ds_exp.tools.dry_run import dry_run

PRESETS = sorted(path.stem for path in (conf_dir() / "model").glob("*.yaml"))
BUILT_HERE = {"tiny"}  # built from model.arch: no checkpoint anywhere
POINTED_BY_HAND = {"local"}  # model.name_or_path=/path/to/dir: nothing to plan until it is given
# Parameters of each preset's checkpoint as published: exact counts (Hugging Face's safetensors totals) where known,
# else the model card's rounded figure, which the count must round to. A preset's arch that misses a layer, a head
# or a size is off by more than that.
PUBLISHED: dict[str, int | str] = {
    "gemma-2-2b": 2_614_341_888,
    "gemma-3-1b": 999_885_952,
    "gemma-3-4b": 4_300_079_472,  # with its SigLIP vision tower, as AutoModelForCausalLM loads it
    "llama-2-7b": 6_738_415_616,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "mistral-7b": 7_248_023_552,
    "opt-1.3b": "1.3B",
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": "0.6B",
    "qwen3-1.7b": "1.7B",
    "qwen3-4b": "4.0B",
    "qwen3-8b": "8.2B",
    "smollm2-135m": 134_515_008,
    "smollm2-360m": 361_821_120,
    "smollm2-1.7b": 1_711_376_384,
}
# presets of a vision-language model (a vision tower beside the language model, as AutoModelForCausalLM loads it)
VISION_LANGUAGE = [
    preset
    for preset in PRESETS
    if "vision_config" in (yaml.safe_load((conf_dir() / "model" / f"{preset}.yaml").read_text())["arch"] or {})
]
# Qwen3's cards give the count without the embedding (and the output layer where it is not tied) too: finer
PUBLISHED_NON_EMBEDDING = {"qwen3-0.6b": "0.44B", "qwen3-1.7b": "1.4B", "qwen3-4b": "3.6B", "qwen3-8b": "6.95B"}


def rounds_to(count: int, figure: str) -> bool:
    """Whether `count` parameters round to a model card's figure ("1.7B": 1.65e9 <= count < 1.75e9)."""
    digits = figure.removesuffix("B")
    half = 0.5 * 10 ** -len(digits.partition(".")[2]) * 1e9
    return float(digits) * 1e9 - half <= count < float(digits) * 1e9 + half


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """A machine that cannot reach the hub and has nothing in its cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_model_preset_composes_and_the_dry_run_plans_it_without_the_hub(
    preset, compose_cfg, no_hub, tmp_path, capsys
):
    cfg = compose_cfg(f"model={preset}", "dry_run=true")
    assert cfg.model.name == preset
    if preset in POINTED_BY_HAND:
        with pytest.raises(ConfigError, match=r"model\.name_or_path is not set"):
            validate(cfg)
        return
    validate(cfg)  # every check the command line makes
    arch = cfg.model.arch
    assert arch, f"conf/model/{preset}.yaml carries no arch: a dry run could not plan it without the model"
    # the architecture passes ds_exp's own checks of one (sizes, heads that divide, even rotary head dimensions)
    assert arch_problems(dataclasses.replace(cfg.model, name_or_path=None)) == []
    if preset not in BUILT_HERE:
        assert plans_from_arch(cfg.model, dry_run=cfg.dry_run), "a hub model that is not here: planned from its arch"
        check_hub(cfg.model, dry_run=cfg.dry_run)  # a dry run that needs no file of the model is not refused
    plan = dry_run(cfg, tmp_path / "run")
    shown = capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["parameters"] == plan["parameters"]
    text = arch.get("text_config") or arch
    assert plan["hidden_size"] == text["hidden_size"]
    mem = plan["memory_per_rank"]
    assert 0 < mem["params_bytes"] <= mem["device_bytes"] + mem["host_bytes"] and mem["activation_bytes"] > 0
    assert plan["estimate_per_rank_bytes"] >= mem["device_bytes"]
    if preset in BUILT_HERE:
        return
    assert "planned from model.arch" in shown and f"{cfg.model.name_or_path} is not on this machine" in shown
    assert plan["vocab_size"] == text["vocab_size"]
    published = PUBLISHED.get(preset)
    assert published is not None, f"add the published parameter count of {cfg.model.name_or_path} to PUBLISHED"
    count = plan["parameters"]
    assert count == published if isinstance(published, int) else rounds_to(count, published), (count, published)
    if preset in PUBLISHED_NON_EMBEDDING:
        embeddings = text["vocab_size"] * text["hidden_size"] * (1 if text.get("tie_word_embeddings") else 2)
        assert rounds_to(count - embeddings, PUBLISHED_NON_EMBEDDING[preset]), (count - embeddings, preset)


def test_the_readme_lists_every_model_preset():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    listed = set(re.findall(r"^\| `model=([\w.-]+)`", readme, flags=re.M))
    assert listed == set(PRESETS) - POINTED_BY_HAND, sorted(listed ^ (set(PRESETS) - POINTED_BY_HAND))


@pytest.mark.parametrize("preset", VISION_LANGUAGE)
def test_a_vision_language_preset_adapts_its_language_model_and_the_dry_run_says_so(
    preset, compose_cfg, no_hub, tmp_path, capsys
):
    """(issue 41 §7) Text rows train the language model: LoRA's default scope there (model.lora_scope), not in the
    vision tower too (gemma-3-4b's SigLIP: 162 adapters more); the dry run counts the adapted layers of each tower,
    and lora.module_name=layers. still adapts both when asked."""
    plan = dry_run(compose_cfg(f"model={preset}", "lora.dim=8", "dry_run=true"), tmp_path / "run")
    parts = plan["lora_targets_by_part"]
    vision, language = ([part for part in parts if kind in part] for kind in ("vision", "language"))
    assert vision and language and sum(parts.values()) == plan["lora_targets"], parts
    assert all(parts[part] == 0 for part in vision) and all(parts[part] > 0 for part in language), parts
    shown = capsys.readouterr().out
    assert f"({plan['lora_targets']} LoRA layers: " in shown and f"0 in {vision[0]}" in shown, shown
    both = dry_run(compose_cfg(f"model={preset}", "lora.dim=8", "lora.module_name=layers.", "dry_run=true"), tmp_path)
    assert all(count > 0 for count in both["lora_targets_by_part"].values()), both["lora_targets_by_part"]
