"""Model config, parameter accounting and model construction (tiny from `arch`, or a checkpoint)."""

from __future__ import annotations

import contextlib
import logging
import zlib
from dataclasses import asdict, dataclass, replace
from types import ModuleType
from typing import Any

import deepspeed
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations import HfDeepSpeedConfig

from ds_exp.config.fast_path import FastPath, decide, toggle
from ds_exp.config.long_context import plan_tiling
from ds_exp.config.model_checks import checkpoint_error
from ds_exp.config.precision import detect_accelerator
from ds_exp.config.schema import Config
from ds_exp.core import compat
from ds_exp.core.errors import ConfigError
from ds_exp.model import sequence_parallel
from ds_exp.model.architecture import (
    base_vocab_size,
    build_model_config,
    checkpoint_dtype,
    hidden_size_of,
    padded_vocab_size,
    text_config,
)
from ds_exp.model.attention import TAKES_BOUNDARIES, attn_implementation
from ds_exp.model.compile import compile_decoder_layers
from ds_exp.model.fused_loss import apply_fused_loss
from ds_exp.model.head_loss import HeadLoss
from ds_exp.model.lora import LoraSpec, lora_spec, prepare_quantized, quantized_loading, tied_elsewhere, wrap_lora
from ds_exp.model.tiling import apply_tiling

log = logging.getLogger(__name__)


def init_weights_by_name(model: PreTrainedModel, seed: int, *, zero3: bool) -> None:
    """Random init that depends only on the seed and each module's name, never on the ZeRO stage.

    Under deepspeed.zero.Init the order in which random numbers are drawn differs from a plain build, so the
    same seed would give different weights at stage 3. Re-running the model's own `_init_weights` module by
    module, each from a generator seeded by (seed, module name), makes every stage start from the same model.
    At stage 3 each module's parameters are gathered for the moment (one module at a time).
    """
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


NO_FAST_PATH = FastPath(liger_kernel=False, fused_loss=False, compile=False)


@dataclass
class BuiltModel:
    model: PreTrainedModel | PeftModel  # PEFT's PeftModel with LoRA
    config: PretrainedConfig  # the vocabulary already padded
    lora: LoraSpec | None
    hf_ds_config: HfDeepSpeedConfig | None  # keeps transformers' ZeRO-3 mode alive while the engine is built
    base_rows: int  # embedding rows before padding (the checkpoint's, for a model loaded from one)
    base_dtype: str  # the dtype the checkpoint's weights are stored in (float32 when built from a config)
    vocab_size: int  # the base vocabulary the export keeps: the tokenizer's, or the checkpoint's if larger
    mpu: ModuleType | None = None  # DeepSpeed's sequence-parallel groups, for deepspeed.initialize (sp size > 1)
    # the fused or the tiled loss (ds_exp.train.step.batch_loss, ds_exp/model/head_loss.py); None: the full logits
    loss: HeadLoss | None = None
    attention: str | None = None  # the attention implementation (None: transformers' default)
    fast: FastPath = NO_FAST_PATH  # what the fast path applied

    def fast_path_record(self) -> dict[str, Any]:
        """What of the fast path the model uses (ds_exp/config/fast_path.py), for summary.json."""
        return {"attention": self.attention or "sdpa", **asdict(self.fast)}

    @property
    def takes_example_boundaries(self) -> bool:
        """Whether packed batches hand the attention their examples' boundaries (ds_exp/model/attention.py)."""
        return self.attention in TAKES_BOUNDARIES and self.mpu is None


def build_model(cfg: Config, tokenizer: PreTrainedTokenizerBase, ds_config: dict[str, Any]) -> BuiltModel:
    """The model to train. At ZeRO-3, transformers builds it inside deepspeed.zero.Init (each rank holds only
    its shard) because an HfDeepSpeedConfig for the final DeepSpeed config is alive during construction."""
    config = build_model_config(cfg.model, tokenizer)
    if cfg.model.gradient_checkpointing:
        config.use_cache = False
    zero3 = ds_config.get("zero_optimization", {}).get("stage") == 3
    hf_ds_config = HfDeepSpeedConfig(ds_config) if zero3 else None
    sp_size, mpu = int(cfg.dist.sequence_parallel_size), None
    attention = attn_implementation(cfg.model.attn_implementation, ds_config, sp_size)
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    fast = decide(cfg, detect_accelerator(), stage)
    if sp_size > 1:
        attention = attention or "sdpa"  # the wrapper needs the name of the attention it wraps
        mpu = sequence_parallel.register(config, attention, sp_size, cfg.train.micro_batch_size)
    extra = {"attn_implementation": attention} if attention else {}
    torch.manual_seed(cfg.train.seed)
    if cfg.model.name_or_path is None:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
    else:
        # a large checkpoint takes a while (transformers' own bar is off: ds_exp/runtime/rank_logging.py)
        log.info("loading the weights of %s ...", cfg.model.name_or_path)
        loading: dict[str, Any] = {"dtype": torch.float32}
        if cfg.lora.dim > 0 and cfg.lora.quantize:  # QLoRA (validation refuses it without CUDA and bitsandbytes)
            loading = quantized_loading(cfg.lora.quantize, _compute_dtype(ds_config))
        try:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.model.name_or_path,
                config=config,
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
    if fast.liger_kernel and not compat.apply_liger_kernels(model):
        if toggle(cfg.model.liger_kernel):
            raise ConfigError(
                f"model.liger_kernel=true: Liger has no kernels for the {config.model_type} model family; set "
                "model.liger_kernel=auto or false"
            )
        fast = replace(fast, liger_kernel=False)
    base_rows = model.get_input_embeddings().num_embeddings
    vocab = padded_vocab_size(len(tokenizer), model.get_input_embeddings().num_embeddings, cfg.model.vocab_multiple)
    if vocab != model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(vocab)  # gathers the embedding under ZeRO-3
        config = model.config
    lora = None
    if cfg.lora.dim > 0:
        lora = lora_spec(cfg.lora, model)
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
    if mpu is not None:
        sequence_parallel.check_model_attention(model, attention or "sdpa")
    plan = plan_tiling(cfg, hidden=hidden_size_of(config) or 1, vocab=int(text_config(config).vocab_size))
    fused = None
    if fast.fused_loss:
        fused = apply_fused_loss(model, str(config.model_type), asked=bool(toggle(cfg.model.fused_loss)))
    fast = replace(fast, fused_loss=fused is not None)
    if fused is not None and plan.loss_chunks:
        log.info("model.tiled_loss: the fused loss computes the logits in chunks already; no tiled loss on top")
        plan = replace(plan, loss_chunks=0)
    loss = apply_tiling(model, plan, str(config.model_type)) or fused
    if plan.mlp_shards or plan.loss_chunks or plan.offload:
        log.info(
            "long context: MLP tiles %s, loss chunks %s, activation offload %s",
            plan.mlp_shards or "off",
            plan.loss_chunks or "off",
            "on" if plan.offload else "off",
        )
    if fast.compile:
        fast = replace(fast, compile=compile_decoder_layers(model) > 0)
    log.info(
        "fast path: attention %s, Liger kernels %s, fused loss %s, compiled decoder layers %s",
        attention or "sdpa (transformers' default)",
        *("on" if on else "off" for on in (fast.liger_kernel, fast.fused_loss, fast.compile)),
    )
    return BuiltModel(
        model=model,
        config=config,
        lora=lora,
        hf_ds_config=hf_ds_config,
        base_rows=base_rows,
        base_dtype=checkpoint_dtype(cfg.model),
        vocab_size=base_vocab_size(cfg.model, tokenizer, base_rows),
        mpu=mpu,
        loss=loss,
        attention=attention,
        fast=fast,
    )
