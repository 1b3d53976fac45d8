"""Model config, parameter accounting and model construction (tiny from `arch`, or a checkpoint)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ds_exp.config.schema import Config, ModelConfig
from ds_exp.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def padded_vocab_size(tokenizer_len: int, current: int, multiple: int) -> int:
    """Never shrink the embedding; round up to `multiple` (DeepSpeed-Chat pads to 8)."""
    return int(multiple * math.ceil(max(tokenizer_len, current) / multiple))


def build_model_config(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The transformers config of the model to train, vocabulary already sized for the tokenizer."""
    from transformers import AutoConfig

    model_cfg = cfg.model
    if model_cfg.name_or_path is None:
        arch = dict(model_cfg.arch or {})
        model_type = arch.pop("model_type", None)
        if model_type is None:
            raise ConfigError(
                "model.arch.model_type is missing: name the architecture, e.g. model.arch.model_type=llama"
            )
        vocab = padded_vocab_size(len(tokenizer), int(arch.pop("vocab_size", 0)), model_cfg.vocab_multiple)
        config = AutoConfig.for_model(model_type, vocab_size=vocab, **arch)
    else:
        try:
            config = AutoConfig.from_pretrained(model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code)
        except (OSError, ValueError, KeyError) as err:
            mapped = checkpoint_error(cfg.model, err)
            if mapped is None:
                raise
            raise mapped from err
    config.pad_token_id = tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        config.eos_token_id = tokenizer.eos_token_id
    if tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
    if model_cfg.disable_dropout:
        disable_dropout_in_config(config)
    return config


def checkpoint_error(model: ModelConfig, err: BaseException, *, weights: bool = False) -> ConfigError | None:
    """transformers' error loading the checkpoint in model.name_or_path (its weights too with `weights`) as one
    message naming the file and the fix; None when its files explain nothing (the error is then raised as is)."""
    from ds_exp.config.model_checks import local_checkpoint, read_config_json, weights_problem

    directory = local_checkpoint(model)
    if directory is None:
        return None
    shown = f"model.name_or_path={model.name_or_path}"
    settings, problem = read_config_json(directory, model.name_or_path)
    if problem is not None:
        return ConfigError(problem)
    text = str(err)
    if settings is not None and ("does not recognize this architecture" in text or "custom code" in text):
        model_type = settings.get("model_type")
        if "auto_map" in settings and not model.trust_remote_code:
            return ConfigError(
                f"{shown}: the checkpoint ships its own model code (auto_map in config.json) for model_type="
                f"{model_type}, which transformers does not have built in; model.trust_remote_code=true runs that "
                "code (only do so for a source you trust), or use a checkpoint of an architecture transformers knows"
            )
        import transformers

        return ConfigError(
            f"{shown}: config.json has model_type={model_type}, which transformers {transformers.__version__} does "
            "not know; upgrade transformers (pip install -U transformers), or set model.trust_remote_code=true if "
            "the checkpoint ships its own model code"
        )
    problem = weights_problem(directory, model.name_or_path) if weights else None
    return ConfigError(problem) if problem is not None else None


def disable_dropout_in_config(config: PretrainedConfig) -> None:
    """Every float dropout probability of the config to 0 (DeepSpeed-Chat's --disable_dropout)."""
    for key, value in config.to_dict().items():
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)


def hidden_size_of(config: Any) -> int | None:
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


def lora_target_names(model: torch.nn.Module, module_name: str) -> list[str]:
    """Full names of the Linear layers inside the `lora.module_name` scope; an error lists candidates."""
    import torch

    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    targets = [name for name in linears if module_name in name]
    if not targets:
        scopes = sorted({name.rsplit(".", 1)[0] + "." for name in linears if "." in name})
        example = ", ".join(scopes[:8]) + (" ..." if len(scopes) > 8 else "")
        raise ConfigError(
            f"lora.module_name={module_name} matches no Linear layer of this model; Linear layers live under: "
            f"{example} (e.g. lora.module_name=layers.)"
        )
    return targets


def count_parameters(cfg: Config, config: PretrainedConfig) -> ParameterCounts:
    """Exact counts from a model built on the meta device: no memory, no weights read."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    total = sum(p.numel() for p in model.parameters())
    if cfg.lora.dim <= 0:
        return ParameterCounts(total, total, ())
    modules = dict(model.named_modules())
    targets = lora_target_names(model, cfg.lora.module_name)
    adapters = sum(cfg.lora.dim * (modules[n].in_features + modules[n].out_features) for n in targets)
    trainable = adapters if cfg.lora.only_optimize else total + adapters
    return ParameterCounts(total + adapters, trainable, tuple(targets))


def init_weights_by_name(model: Any, seed: int, *, zero3: bool) -> None:
    """Random init that depends only on the seed and each module's name, never on the ZeRO stage.

    Under deepspeed.zero.Init the order in which random numbers are drawn differs from a plain build, so the
    same seed would give different weights at stage 3. Re-running the model's own `_init_weights` module by
    module, each from a generator seeded by (seed, module name), makes every stage start from the same model.
    At stage 3 each module's parameters are gathered for the moment (one module at a time).
    """
    import contextlib
    import zlib

    import torch

    from ds_exp import compat

    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        if zero3:
            import deepspeed

            gather: Any = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
        else:
            gather = contextlib.nullcontext()
        with gather, torch.no_grad():
            torch.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            compat.reinit_module(model, module)


@dataclass(frozen=True)
class LoraSpec:
    """What PEFT needs to wrap (and later rebuild for export) the same adapters."""

    dim: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    only_optimize: bool


def wrap_lora(model: Any, spec: LoraSpec) -> Any:
    """PEFT LoRA on exactly the listed Linear layers: W x + (alpha / r) B(A(dropout(x))), B = 0 at start."""
    from peft import LoraConfig, get_peft_model

    peft_config = LoraConfig(
        r=spec.dim,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, peft_config)
    if not spec.only_optimize:
        for name, param in wrapped.named_parameters():
            if "lora_" not in name:
                param.requires_grad_(True)
    return wrapped


def attn_implementation(requested: str | None, ds_config: dict[str, Any]) -> str | None:
    """model.attn_implementation with auto decided: flash_attention_2 where flash-attn imports, a GPU is there and
    the weights are 16-bit (its kernels need them), else transformers' default. Packed batches then run as
    variable-length sequences (transformers reads the example boundaries from position_ids)."""
    if requested != "auto":
        return requested
    import importlib.util

    import torch

    half = any(ds_config.get(key, {}).get("enabled") is True for key in ("bf16", "fp16"))
    if half and torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    log.info("model.attn_implementation=auto: flash-attn is not usable here (needs the package, a GPU and bf16/fp16)")
    return None


@dataclass
class BuiltModel:
    model: Any
    config: Any  # the transformers config (vocabulary already padded)
    lora: LoraSpec | None
    hf_ds_config: Any  # keeps transformers' ZeRO-3 mode alive while the engine is built
    base_rows: int  # embedding rows before padding (the checkpoint's, for a model loaded from one)
    base_dtype: str  # the dtype the checkpoint's weights are stored in (float32 when built from a config)
    vocab_size: int  # the base vocabulary the export keeps: the tokenizer's, or the checkpoint's if larger


def build_model(cfg: Config, tokenizer: PreTrainedTokenizerBase, ds_config: dict[str, Any]) -> BuiltModel:
    """The model to train. At ZeRO-3, transformers builds it inside deepspeed.zero.Init (each rank holds only
    its shard) because an HfDeepSpeedConfig for the final DeepSpeed config is alive during construction."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    config = build_model_config(cfg, tokenizer)
    if cfg.model.gradient_checkpointing:
        config.use_cache = False
    zero3 = ds_config.get("zero_optimization", {}).get("stage") == 3
    hf_ds_config = HfDeepSpeedConfig(ds_config) if zero3 else None
    attention = attn_implementation(cfg.model.attn_implementation, ds_config)
    extra = {"attn_implementation": attention} if attention else {}
    torch.manual_seed(cfg.train.seed)
    if cfg.model.name_or_path is None:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.model.name_or_path,
                config=config,
                dtype=torch.float32,
                trust_remote_code=cfg.model.trust_remote_code,
                **extra,
            )
        except Exception as err:  # safetensors and torch raise their own types for a damaged file
            mapped = checkpoint_error(cfg.model, err, weights=True)
            if mapped is None:
                raise
            raise mapped from err
    if cfg.model.name_or_path is None:
        init_weights_by_name(model, cfg.train.seed, zero3=zero3)
    if cfg.model.liger_kernel:
        from ds_exp import compat

        compat.apply_liger_kernels(model)
    base_rows = model.get_input_embeddings().num_embeddings
    vocab = padded_vocab_size(len(tokenizer), model.get_input_embeddings().num_embeddings, cfg.model.vocab_multiple)
    if vocab != model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(vocab)  # gathers the embedding under ZeRO-3
        config = model.config
    lora = None
    if cfg.lora.dim > 0:
        lora = LoraSpec(
            dim=int(cfg.lora.dim),
            alpha=float(cfg.lora.alpha if cfg.lora.alpha is not None else cfg.lora.dim),
            dropout=float(cfg.lora.dropout),
            targets=tuple(lora_target_names(model, cfg.lora.module_name)),
            only_optimize=bool(cfg.lora.only_optimize),
        )
        torch.manual_seed(cfg.train.seed + 1)  # adapters start the same whatever the ZeRO stage consumed above
        model = wrap_lora(model, lora)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # frozen embeddings (LoRA only) would leave checkpointed blocks without inputs that require grad
        model.enable_input_require_grads()
    return BuiltModel(
        model=model,
        config=config,
        lora=lora,
        hf_ds_config=hf_ds_config,
        base_rows=base_rows,
        base_dtype=checkpoint_dtype(cfg),
        vocab_size=base_vocab_size(cfg, tokenizer, base_rows),
    )


def base_vocab_size(cfg: Config, tokenizer: PreTrainedTokenizerBase, checkpoint_rows: int) -> int:
    """The vocabulary an export keeps (model.vocab_multiple's padding rows trimmed): the tokenizer's size, or the
    base's own if larger (the checkpoint's embedding rows; model.arch.vocab_size for a model built from a config,
    whose config is padded already)."""
    own = checkpoint_rows if cfg.model.name_or_path else int((cfg.model.arch or {}).get("vocab_size") or 0)
    return max(len(tokenizer), own)


def checkpoint_dtype(cfg: Config) -> str:
    """The dtype a checkpoint's weights are stored in, from its config.json (float32 when unsaid or built)."""
    if cfg.model.name_or_path is None:
        return "float32"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"
