"""Model config, parameter accounting and model construction (tiny from `arch`, or a checkpoint)."""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations import HfDeepSpeedConfig

from ds_exp.config.features import feature_hooks, feature_settings
from ds_exp.config.model_checks import checkpoint_error
from ds_exp.config.schema import Config
from ds_exp.core import compat
from ds_exp.model.architecture import base_vocab_size, build_model_config, checkpoint_dtype, padded_vocab_size
from ds_exp.model.hooks import ModelBuild, ModelHooks
from ds_exp.model.lora import LoraSpec, lora_spec, prepare_quantized, quantized_loading, tied_elsewhere, wrap_lora

log = logging.getLogger(__name__)


def init_weights_by_name(model: PreTrainedModel, seed: int, *, zero3: bool) -> None:
    """Random init from the seed and each module's name only, so every ZeRO stage starts from the same model."""
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        if zero3:
            gather: contextlib.AbstractContextManager[None] = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
        else:
            gather = contextlib.nullcontext()
        with gather, torch.no_grad():
            torch.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            compat.reinit_module(model, module)


def _compute_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The dtype the engine trains in: a quantized base computes in it."""
    if ds_config.get("bf16", {}).get("enabled") is True:
        return torch.bfloat16
    return torch.float16 if ds_config.get("fp16", {}).get("enabled") is True else torch.float32


@dataclass(kw_only=True)
class BuiltModel(ModelBuild):
    """The model to train, and what the features' points left for the run (ds_exp/model/hooks.py)."""

    model: PreTrainedModel | PeftModel  # PEFT's PeftModel with LoRA
    lora: LoraSpec | None
    hf_ds_config: HfDeepSpeedConfig | None  # keeps transformers' ZeRO-3 mode alive while the engine is built
    base_rows: int  # embedding rows before padding (the checkpoint's, for a model loaded from one)
    base_dtype: str  # the dtype the checkpoint's weights are stored in (float32 when built from a config)
    vocab_size: int  # the base vocabulary the export keeps: the tokenizer's, or the checkpoint's if larger


def build_model(
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
    ds_config: dict[str, Any],
    hooks: Sequence[object] | None = None,
    auto_class: Any = AutoModelForCausalLM,
) -> BuiltModel:
    """The model to train (ZeRO-3: inside deepspeed.zero.Init); `hooks` None: those cfg turns on."""
    points = [
        h for h in (feature_hooks(feature_settings(cfg)) if hooks is None else hooks) if isinstance(h, ModelHooks)
    ]
    build = ModelBuild(
        config=build_model_config(cfg.model, tokenizer),
        ds_config=ds_config,
        attention=cfg.model.attn_implementation,
        auto_class=auto_class,
    )
    if auto_class is not AutoModelForCausalLM:
        build.config.num_labels = 1
        pad = tokenizer.pad_token_id
        build.config.pad_token_id = pad if pad is not None else tokenizer.eos_token_id
    if cfg.model.gradient_checkpointing:
        build.config.use_cache = False
    zero3 = ds_config.get("zero_optimization", {}).get("stage") == 3
    hf_ds_config = HfDeepSpeedConfig(ds_config) if zero3 else None
    for hook in points:
        hook.before_weights(build)
    extra = {"attn_implementation": build.attention} if build.attention else {}
    torch.manual_seed(cfg.train.seed)
    if cfg.model.name_or_path is None:
        model = auto_class.from_config(build.config, dtype=torch.float32, **extra)
    else:
        # a large checkpoint takes a while (transformers' own bar is off: ds_exp/runtime/rank_logging.py)
        log.info("loading the weights of %s ...", cfg.model.name_or_path)
        loading: dict[str, Any] = {"dtype": torch.float32}
        if cfg.lora.dim > 0 and cfg.lora.quantize:  # QLoRA (validation refuses it without CUDA and bitsandbytes)
            loading = quantized_loading(cfg.lora.quantize, _compute_dtype(ds_config))
        try:
            model = auto_class.from_pretrained(
                cfg.model.name_or_path,
                config=build.config,
                trust_remote_code=cfg.model.trust_remote_code,
                **loading,
                **extra,
            )
        except Exception as err:  # safetensors and torch raise their own types for a damaged file
            mapped = checkpoint_error(cfg.model, err, weights=True)
            if mapped is None:
                raise
            raise mapped from err
    if cfg.model.name_or_path is None:
        init_weights_by_name(model, cfg.train.seed, zero3=zero3)
    for hook in points:
        hook.after_weights(model, build)
    base_rows = model.get_input_embeddings().num_embeddings
    vocab = padded_vocab_size(len(tokenizer), model.get_input_embeddings().num_embeddings, cfg.model.vocab_multiple)
    if vocab != model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(vocab)  # gathers the embedding under ZeRO-3
        build.config = model.config
    lora = None
    if cfg.lora.dim > 0:
        lora = lora_spec(cfg.lora, model, cfg.model.lora_scope)
        for saved, other in tied_elsewhere(model, lora.modules_to_save):
            log.info("lora.modules_to_save: %s shares its weights with %s; it is trained as its own copy", saved, other)
        if lora.quantize:
            model = prepare_quantized(model)
        torch.manual_seed(cfg.train.seed + 1)  # adapters start the same whatever the ZeRO stage consumed above
        model = wrap_lora(model, lora)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # frozen embeddings (LoRA only) would leave checkpointed blocks without inputs that require grad
        model.enable_input_require_grads()
    for hook in points:
        hook.after_wrap(model, build)
    return BuiltModel(
        **vars(build),
        model=model,
        lora=lora,
        hf_ds_config=hf_ds_config,
        base_rows=base_rows,
        base_dtype=checkpoint_dtype(cfg.model),
        vocab_size=base_vocab_size(cfg.model, tokenizer, base_rows),
    )
