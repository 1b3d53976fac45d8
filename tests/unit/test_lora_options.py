"""LoRA as PEFT's users know it (issue 22 §5): lora.target_modules (names, a regex, all-linear) within the
DeepSpeed-Chat scope lora.module_name, lora.modules_to_save, DoRA, rsLoRA, QLoRA's refusal without CUDA; each
checked by name before the weights load, counted by the dry run, kept by checkpoints (a changed one is refused),
exported merged and as an adapter that agree, and resumed exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_exp.config.lora_checks import lora_problems
from ds_exp.core.errors import ConfigError
from ds_exp.resume.settings import changes, lora_settings
from tests.training import FAST, assert_close, train_here

LORA = ["lora.dim=8", "lora.target_modules=[q_proj,v_proj]", "lora.modules_to_save=[lm_head]"]
VARIANTS = [*LORA, "lora.use_dora=true", "lora.use_rslora=true"]


def tiny(compose_cfg, *overrides: str, meta: bool = True):
    """The tiny model as the run builds it (before LoRA), and its config."""
    from transformers import AutoModelForCausalLM

    from ds_exp.model.architecture import build_model_config
    from ds_exp.model.tokenizer import load_tokenizer

    cfg = compose_cfg(*overrides)
    config = build_model_config(cfg.model, load_tokenizer(cfg.model, cfg.data))
    with torch.device("meta" if meta else "cpu"):
        return AutoModelForCausalLM.from_config(config), cfg


ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LAYER_LINEARS = (*ATTENTION, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
IN_LAYERS = [f"model.layers.{i}.{m}" for i in (0, 1) for m in LAYER_LINEARS]
MLP_DOWN = "model.layers.1.mlp.down_proj"
Q_AND_V = [f"model.layers.{i}.self_attn.{m}_proj" for i in (0, 1) for m in "qv"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], IN_LAYERS),  # DeepSpeed-Chat's scope, lora.module_name's default
        (["lora.target_modules=[q_proj,v_proj]"], Q_AND_V),
        (["lora.target_modules='.*layers\\.1\\.mlp\\.(up|down)_proj'"], ["model.layers.1.mlp.up_proj", MLP_DOWN]),
        (["lora.target_modules=all-linear"], IN_LAYERS),  # every Linear layer but lm_head
        (["lora.module_name=layers.0.", "lora.target_modules=[o_proj]"], ["model.layers.0.self_attn.o_proj"]),
    ],
    ids=["default scope", "names", "regex", "all-linear", "scope and names"],
)
def test_target_modules_select_what_peft_wraps(compose_cfg, overrides, expected):
    from ds_exp.model.lora import lora_spec, wrap_lora

    model, cfg = tiny(compose_cfg, "lora.dim=4", *overrides, meta=False)
    spec = lora_spec(cfg.lora, model)
    assert sorted(spec.targets) == sorted(expected)
    wrapped = wrap_lora(model, spec)
    adapted = [n.removeprefix("base_model.model.") for n, m in wrapped.named_modules() if hasattr(m, "lora_A")]
    assert sorted(adapted) == sorted(expected)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["lora.target_modules=[qkv_proj]"], ["lora.target_modules: qkv_proj matches no Linear layer", "down_proj"]),
        (["lora.target_modules=[embed_tokens]"], ["embed_tokens is a Embedding, not a Linear", "modules_to_save"]),
        (["lora.target_modules=q_proj"], ["(a regular expression, matched against whole names)", "[q_proj]"]),
        (["lora.module_name=decoder.layers."], ["decoder.layers. matches no Linear", "model.layers.0.mlp."]),
        (["lora.modules_to_save=[output]", "lora.target_modules=[q_proj]"], ["output matches no module", "lm_head"]),
        (["lora.modules_to_save=[q_proj]"], ["matches model.layers.0.self_attn.q_proj, which holds LoRA adapters"]),
    ],
    ids=["unknown name", "not linear", "plain name as regex", "scope", "save unknown", "save adapted"],
)
def test_a_lora_setting_that_matches_nothing_names_the_models_layers(compose_cfg, overrides, fragments):
    from ds_exp.model.architecture import build_model_config, check_lora
    from ds_exp.model.tokenizer import load_tokenizer

    cfg = compose_cfg("lora.dim=4", *overrides)

    with pytest.raises(ConfigError) as err:
        check_lora(cfg.model, cfg.lora, build_model_config(cfg.model, load_tokenizer(cfg.model, cfg.data)))
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    assert len(err.value.problems) == 1, err.value.problems


@pytest.mark.parametrize(
    "overrides",
    [
        ["lora.use_dora=true", "lora.target_modules=all-linear"],
        ["lora.use_rslora=true", "lora.modules_to_save=[lm_head]"],  # tied to the input embedding
        ["lora.modules_to_save=[model.norm,embed_tokens]", "lora.only_optimize=false"],
        ["lora.modules_to_save=[lm_head]", "lora.only_optimize=false", "lora.use_dora=true"],
    ],
    ids=["dora all-linear", "rslora tied lm_head", "saved modules, base trained", "tied, base trained, dora"],
)
def test_the_dry_runs_counts_are_the_wrapped_models(compose_cfg, overrides):
    """count_parameters (dry run, autotune) counts on the meta device what the run's wrapped model holds."""
    from ds_exp.model.architecture import count_parameters
    from ds_exp.model.build import build_model
    from ds_exp.model.tokenizer import load_tokenizer

    cfg = compose_cfg("lora.dim=8", *overrides)
    built = build_model(cfg, load_tokenizer(cfg.model, cfg.data), {"zero_optimization": {"stage": 0}})
    total = sum(p.numel() for p in built.model.parameters())
    trainable = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
    counts = count_parameters(cfg.model, cfg.lora, built.config)
    assert (counts.total, counts.trainable) == (total, trainable)


def test_dora_and_rslora_reach_peft(compose_cfg):
    from ds_exp.model.lora import lora_spec, wrap_lora

    options = ("lora.dim=16", "lora.alpha=8", "lora.use_dora=true", "lora.use_rslora=true")
    model, cfg = tiny(compose_cfg, *options, meta=False)
    spec = lora_spec(cfg.lora, model)
    wrapped = wrap_lora(model, spec)
    layer = wrapped.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    assert layer.scaling["default"] == pytest.approx(8 / 16**0.5) == pytest.approx(spec.scaling)
    assert layer.use_dora["default"] and "default" in layer.lora_magnitude_vector


def test_checkpoints_depend_on_every_lora_option(compose_cfg):
    """A resume with any LoRA option changed is refused (ds_exp/resume/settings.py); a checkpoint written before the
    options existed (four keys) still matches the defaults."""
    base = lora_settings(compose_cfg("lora.dim=8").lora)
    assert base == {"dim": 8, "alpha": 8.0, "module_name": "layers.", "only_optimize": True}
    for override in [
        "lora.target_modules=[q_proj]",
        "lora.modules_to_save=[lm_head]",
        "lora.use_dora=true",
        "lora.use_rslora=true",
        "lora.module_name=layers.0.",
    ]:
        found = changes({"lora": base}, {"lora": lora_settings(compose_cfg("lora.dim=8", override).lora)})
        assert len(found) == 1 and found[0].startswith("lora: "), (override, found)


def test_a_base_model_is_known_by_its_place_however_spelled_or_by_its_hash():
    """Issue 39 §6: a trailing slash is the same model; another place is another model, unless the checkpoint
    records its frozen base's SHA-256 (the build checks it then)."""
    assert changes({"model": "/data/base/"}, {"model": "/data/base"}) == []
    assert changes({"model": "~/base"}, {"model": str(Path("~/base").expanduser()) + "/"}) == []
    (line,) = changes({"model": "/data/base"}, {"model": "/elsewhere/base"})
    assert line == "model: /data/base in the checkpoint, /elsewhere/base now (the weights belong to another model)"
    assert changes({"model": "/data/base"}, {"model": "/elsewhere/base"}, hashed=True) == []
    assert len(changes({"model": "/data/base"}, {"model": {"hidden_size": 8}}, hashed=True)) == 1


@pytest.mark.parametrize(
    ("overrides", "accelerator", "has_bnb", "fragment"),
    [
        (["lora.use_dora=true"], "cpu", True, "lora.use_dora is set but LoRA is off (lora.dim=0)"),
        (["lora.dim=8", "lora.target_modules='(q'"], "cpu", True, "is not a valid regular expression"),
        (["lora.dim=8", "lora.target_modules=[]"], "cpu", True, "give a non-empty list of layer names"),
        (["lora.dim=8", "lora.quantize=4bit"], "cpu", True, "needs a CUDA GPU and bitsandbytes, and this is cpu"),
        (["lora.dim=8", "lora.quantize=2bit"], "cuda", True, "give 4bit, 8bit or null"),
        (["lora.dim=8", "lora.quantize=8bit"], "cuda", False, "pip install bitsandbytes"),
        (["lora.dim=8", "lora.quantize=4bit"], "cuda", True, "quantization loads a checkpoint; set model.name_or_path"),
        (["lora.dim=8", "lora.quantize=4bit", "zero=stage3"], "cuda", True, "not with ZeRO-3"),
    ],
    ids=[
        "option without lora",
        "bad regex",
        "empty list",
        "qlora on cpu",
        "qlora 2bit",
        "no bitsandbytes",
        "qlora tiny",
        "qlora zero3",
    ],
)
def test_lora_settings_are_refused_before_anything_loads(
    compose_cfg, monkeypatch, overrides, accelerator, has_bnb, fragment
):
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *args):  # bitsandbytes installed or not, whatever this machine has
        return (object() if has_bnb else None) if name == "bitsandbytes" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    cfg = compose_cfg(*overrides)
    problems = lora_problems(cfg.lora, accelerator, name_or_path=cfg.model.name_or_path, zero_stage=cfg.zero.stage)
    assert any(fragment in p for p in problems), problems


@pytest.mark.slow
def test_lora_options_export_and_resume_exactly(tmp_path, cache_dir, compose_cfg):
    """One run with target_modules, modules_to_save (the tied lm_head), DoRA and rsLoRA: its merged export gives the
    adapter model's outputs (and the adapter says what it is); a resume from its middle checkpoint at ZeRO-3
    continues exactly (same losses, same export); a resume with a LoRA option changed is refused before anything
    loads."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ds_exp.model.build import build_model
    from ds_exp.model.tokenizer import load_tokenizer

    common = [*FAST, "train.max_steps=6", "train.save_every=3", "train.export=true"]
    common += ["scheduler=constant", *VARIANTS]
    first = train_here(tmp_path / "first", *common, cache_dir=cache_dir)
    assert first.ok, first.explain()
    step3 = first.run_dir / "checkpoints" / "step3"

    refused = train_here(tmp_path / "refused", *common, f"resume={step3}", "lora.use_dora=false", cache_dir=cache_dir)
    assert refused.proc.returncode != 0 and "Traceback" not in refused.proc.stderr
    assert "- lora: " in refused.proc.stderr and "use_dora" in refused.proc.stderr, refused.explain()
    assert not (tmp_path / "refused" / "summary.json").exists()

    # at ZeRO-3: the checkpoint goes through DeepSpeed's universal format, adapters, magnitudes and copies included
    resumed = train_here(tmp_path / "resumed", *common, f"resume={step3}", "zero=stage3", cache_dir=cache_dir)
    assert resumed.ok, resumed.explain()
    assert_close(resumed.losses, first.losses[3:], rel=1e-6)
    a, b = (load_file(run.run_dir / "hf_model" / "model.safetensors") for run in (first, resumed))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    # its ZeRO-3 checkpoint holds only what trains (the base: rebuilt); exported, it is the run's own export
    from ds_exp.exports.cli import export_main

    step6 = resumed.run_dir / "checkpoints" / "step6"
    assert export_main([str(step6), str(tmp_path / "m6")]) == 0
    c = load_file(tmp_path / "m6" / "model.safetensors")
    assert c.keys() == b.keys() and all(torch.equal(c[key], b[key]) for key in b)

    config = json.loads((first.run_dir / "hf_model_adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] and config["use_rslora"] and config["modules_to_save"] == ["lm_head"]
    assert sorted(config["target_modules"]) == sorted(Q_AND_V)
    assert json.loads((first.run_dir / "hf_model" / "ds_exp_export.json").read_text())["lora"]["use_dora"] is True

    merged = AutoModelForCausalLM.from_pretrained(first.run_dir / "hf_model").eval()
    cfg = compose_cfg()  # the base under the adapters is the initial model, rebuilt from the same seed
    base = build_model(cfg, load_tokenizer(cfg.model, cfg.data), {"zero_optimization": {"stage": 0}}).model.eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(input_ids=ids).logits
        adapter = PeftModel.from_pretrained(base, first.run_dir / "hf_model_adapter").eval()
        expected = adapter(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
    assert (expected - before).abs().max() > 1e-3  # training moved the outputs: the comparison is not vacuous
    assert not merged.config.tie_word_embeddings  # the trained lm_head is its own now
