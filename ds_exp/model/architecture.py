"""The model's architecture without weights: its transformers config, vocabulary padding, parameter counts."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerBase

from ds_exp.config.model_checks import checkpoint_error
from ds_exp.config.schema import Config, LoraConfig, ModelConfig
from ds_exp.core.errors import ConfigError
from ds_exp.launch.hub import plans_from_arch
from ds_exp.model.lora import adapted_by_part, count_with_lora, lora_spec
from ds_exp.model.tokenizer import load_tokenizer


def padded_vocab_size(tokenizer_len: int, current: int, multiple: int) -> int:
    """Never shrink the embedding; round up to `multiple` (DeepSpeed-Chat pads to 8)."""
    return int(multiple * math.ceil(max(tokenizer_len, current) / multiple))


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config: a vision-language model's text_config (gemma-3-4b), else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def config_from_arch(model: ModelConfig, tokenizer_len: int) -> PretrainedConfig:
    """model.arch as a transformers config, its vocabulary at least the tokenizer's (0: as published)."""
    arch = dict(model.arch or {})
    model_type = arch.pop("model_type", None)
    if model_type is None:
        raise ConfigError("model.arch.model_type is missing: name the architecture, e.g. model.arch.model_type=llama")
    nested = isinstance(arch.get("text_config"), dict)  # a vision-language model: the vocabulary is its text's
    vocab = padded_vocab_size(tokenizer_len, int(arch.pop("vocab_size", 0) or 0), model.vocab_multiple)
    try:
        config = AutoConfig.for_model(model_type, **arch, **({} if nested else {"vocab_size": vocab}))
    except Exception as err:  # transformers' own checks of a family (strict dataclass validators, ValueError)
        first = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(
            f"model.arch: transformers cannot build a {model_type} from these values ({first}); fix the "
            "model.arch values it names"
        ) from err
    text = text_config(config)
    text.vocab_size = padded_vocab_size(tokenizer_len, int(text.vocab_size or 0), model.vocab_multiple)
    if not text.vocab_size:
        raise ConfigError(
            f"model.arch.vocab_size is missing: the dry run of {model.name_or_path} (not on this machine) plans "
            "from model.arch; give the vocab_size of its config.json"
        )
    return config


def build_model_config(model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase | None) -> PretrainedConfig:
    """The transformers config of the model to train, vocabulary sized for the tokenizer (None: a dry run's)."""
    if model_cfg.name_or_path is None or tokenizer is None:
        config = config_from_arch(model_cfg, len(tokenizer) if tokenizer is not None else 0)
    else:
        try:
            config = AutoConfig.from_pretrained(model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code)
        except (OSError, ValueError, KeyError) as err:
            mapped = checkpoint_error(model_cfg, err)
            if mapped is None:
                raise
            raise mapped from err
    if tokenizer is not None:
        config.pad_token_id = tokenizer.pad_token_id
        if tokenizer.eos_token_id is not None:
            config.eos_token_id = tokenizer.eos_token_id
        if tokenizer.bos_token_id is not None:
            config.bos_token_id = tokenizer.bos_token_id
    if model_cfg.disable_dropout:
        disable_dropout_in_config(config)
    if model_cfg.rope_scaling:
        apply_rope_scaling(config, dict(model_cfg.rope_scaling))
    return config


def apply_rope_scaling(config: PretrainedConfig, scaling: dict[str, Any]) -> None:
    """model.rope_scaling merged into the config's rope_parameters, then checked by transformers' own validation."""
    shown = "model.rope_scaling={" + ",".join(f"{k}:{v}" for k, v in scaling.items()) + "}"
    current = getattr(config, "rope_parameters", None)
    if not isinstance(current, dict):
        raise ConfigError(f"{shown}: the {config.model_type} model has no rotary position embeddings to scale")
    if config.nested_rope_parameter_keys(current):
        raise ConfigError(
            f"{shown}: the {config.model_type} model keeps rotary parameters per layer type "
            f"({', '.join(config.nested_rope_parameter_keys(current))}); set them in its config.json instead"
        )
    if "type" in scaling:  # the key's old name
        scaling.setdefault("rope_type", scaling.pop("type"))
    config.rope_parameters = {**current, **scaling}
    try:
        config.standardize_rope_params()
        config.validate_rope()
    except (KeyError, ValueError, TypeError) as err:
        raise ConfigError(f"{shown}: {str(err).strip(chr(34))}") from None


def model_facts(cfg: Config, auto_class: Any = AutoModelForCausalLM) -> dict[str, int]:
    """Parameter counts and shapes for the memory estimate, from the config on the meta device."""
    model = cfg.model
    tokenizer = None if plans_from_arch(model, dry_run=cfg.dry_run) else load_tokenizer(model, cfg.data)
    config = build_model_config(model, tokenizer)
    text = text_config(config)
    text.vocab_size = padded_vocab_size(len(tokenizer or ()), text.vocab_size, model.vocab_multiple)
    counts = count_parameters(model, cfg.lora, config, auto_class)
    hidden = int(hidden_size_of(config) or 0)
    language_model = auto_class is AutoModelForCausalLM
    intermediate = getattr(text, "intermediate_size", None) or getattr(text, "ffn_dim", None)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    return {
        "total": counts.total,
        "trainable": counts.trainable,
        "hidden": hidden,
        "intermediate": int(intermediate or 4 * hidden),
        "layers": int(getattr(text, "num_hidden_layers", 0) or 0),
        "vocab": int(text.vocab_size),
        "outputs": int(text.vocab_size) if language_model else 1,
        "heads": heads,
        "kv_heads": int(getattr(text, "num_key_value_heads", 0) or heads),
        "tied": int(  # a reward model has no output layer to tie
            language_model and bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
        ),
    }


def disable_dropout_in_config(config: PretrainedConfig) -> None:
    """Every float dropout probability of the config to 0 (DeepSpeed-Chat's --disable_dropout)."""
    for key, value in config.to_dict().items():
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)


def hidden_size_of(config: PretrainedConfig) -> int | None:
    """hidden_size, else the largest of hidden_sizes, else the same of a nested text_config."""
    for candidate in (config, getattr(config, "text_config", None)):
        if candidate is None:
            continue
        if getattr(candidate, "hidden_size", None):
            return int(candidate.hidden_size)
        if getattr(candidate, "hidden_sizes", None):
            return int(max(candidate.hidden_sizes))
    return None


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # of the base model
    trainable: int  # what the optimizer updates (adapters only with lora.only_optimize)
    lora_targets: tuple[str, ...]
    lora_parts: dict[str, int] = field(default_factory=dict)  # adapted layers per tower (lora.adapted_by_part)


def count_parameters(
    model_cfg: ModelConfig, lora: LoraConfig, config: PretrainedConfig, auto_class: Any = AutoModelForCausalLM
) -> ParameterCounts:
    """Exact counts from a model built on the meta device: no memory, no weights read."""
    if auto_class is not AutoModelForCausalLM:  # a one-label head, as the build makes it (ds_exp/model/build.py)
        config = copy.copy(config)
        config.num_labels = 1
    with torch.device("meta"):
        model = auto_class.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    total = sum(p.numel() for p in model.parameters())
    if lora.dim <= 0:
        return ParameterCounts(total, total, ())
    spec = lora_spec(lora, model, model_cfg.lora_scope)  # a ConfigError names what lora.* matches nothing of
    total, trainable = count_with_lora(model, spec)
    return ParameterCounts(total, trainable, spec.targets, adapted_by_part(model, spec.targets))


def check_lora(model_cfg: ModelConfig, lora: LoraConfig, config: PretrainedConfig) -> None:
    """lora.* against the model's layers on the meta device, before data and weights: one message naming its Linears."""
    if lora.dim > 0:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
        lora_spec(lora, model, model_cfg.lora_scope)


def base_vocab_size(model: ModelConfig, tokenizer: PreTrainedTokenizerBase | None, checkpoint_rows: int) -> int:
    """The vocabulary an export keeps (padding rows trimmed): the tokenizer's size, or the base's own if larger."""
    own = checkpoint_rows if model.name_or_path else int((model.arch or {}).get("vocab_size") or 0)
    return max(len(tokenizer or ()), own)


def checkpoint_dtype(model: ModelConfig) -> str:
    """The dtype a checkpoint's weights are stored in, from its config.json (float32 when unsaid or built)."""
    if model.name_or_path is None:
        return "float32"

    config = AutoConfig.from_pretrained(model.name_or_path, trust_remote_code=model.trust_remote_code)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"
