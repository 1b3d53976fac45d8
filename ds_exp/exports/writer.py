"""Export the trained model in Hugging Face format with the base model's identity: rank 0 gathers the full weights
(ZeRO-3: layer by layer) to the CPU, merges LoRA in fp32, and renames a complete temporary directory into place, keeping
the base's vocabulary, tokenizer, generation config and precision; ds_exp_export.json says the dtype and why, the
template, stop tokens and origin."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations.deepspeed import unset_hf_deepspeed_config
from transformers.utils import logging as hf_logging

from ds_exp.checkpoint.checkpointer import CHECKPOINT_TYPES
from ds_exp.checkpoint.frozen import built_base, load_trained
from ds_exp.checkpoint.universal import MODEL_STATES
from ds_exp.config.paths import data_cache_dir
from ds_exp.config.schema import Config, DataConfig, ModelConfig, plain
from ds_exp.core import compat
from ds_exp.core.errors import Diverged, RunFailed, first_line
from ds_exp.core.files import json_text
from ds_exp.data.cache import read_meta
from ds_exp.data.templates import first_template, resolve_template
from ds_exp.exports.checks import check_target
from ds_exp.exports.on_disk import METADATA, adapter_dir
from ds_exp.launch.storage import export_failure_message
from ds_exp.model.architecture import text_config
from ds_exp.model.build import BuiltModel, build_model
from ds_exp.model.lora import LoraSpec, merge_lora, wrap_lora
from ds_exp.model.tokenizer import load_tokenizer, tokenizer_source
from ds_exp.resume.store import read_marker
from ds_exp.runtime.process_group import broadcast
from ds_exp.train.generate import stop_token_ids

log = logging.getLogger(__name__)

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# What a tokenizer is made of on disk (any that the source has are copied).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
WRITTEN_BY = "python -m ds_exp.export"  # origin.written_by of the exports of a checkpoint


@dataclass(frozen=True)
class ExportSpec:
    """What the export needs to know about the base model and the run, besides the trained weights."""

    model_config: PretrainedConfig  # the trained model's transformers config (vocabulary padded)
    base_path: str | None  # the checkpoint the base weights were loaded from; None = built from a config
    base_dtype: str  # float32 | bfloat16 | float16: the dtype of the base checkpoint's weights
    base_rows: int  # embedding rows of the base checkpoint (of the config when built from one)
    vocab_size: int  # the base vocabulary: the tokenizer's size, or the checkpoint's if larger
    tokenizer_source: str  # the directory the tokenizer was loaded from
    lora: LoraSpec | None
    precision: str  # the training precision: fp32 | bf16 | fp16
    dtype: str = "auto"  # train.export_dtype: auto | fp32 | bf16 | fp16
    trust_remote_code: bool = False
    template: str | None = None  # how the run asked the model: raw | dschat | chat_template
    stop_token_ids: tuple[int, ...] = ()  # where the run's generations stop
    origin: dict[str, Any] | None = None  # where the weights come from (a run and its step, or a checkpoint)
    dtype_key: str = "train.export_dtype"  # how the user chose `dtype` (python -m ds_exp.export: --dtype)
    auto_class: Any = AutoModelForCausalLM  # what the model is (a reward model: AutoModelForSequenceClassification)


def export_spec(model: ModelConfig, built: BuiltModel, precision: str, **more: Any) -> ExportSpec:
    """The spec of an export of `built`, as `model` built it; `more`: dtype, template, stop_token_ids, origin."""
    return ExportSpec(
        model_config=built.config,
        base_path=model.name_or_path,
        base_dtype=built.base_dtype,
        base_rows=built.base_rows,
        vocab_size=built.vocab_size,
        tokenizer_source=tokenizer_source(model),
        lora=built.lora,
        precision=precision,
        trust_remote_code=bool(model.trust_remote_code),
        auto_class=built.auto_class,
        **more,
    )


def gather_full_state_dict(engine: DeepSpeedEngine, zero_stage: int) -> dict[str, torch.Tensor] | None:
    """Collective. The whole state dict on rank 0 (None on the other ranks)."""
    if zero_stage == 3:
        state = compat.zero3_full_state_dict(engine)  # gathers per layer onto rank 0; keeps the dtype
    else:
        state = engine.module.state_dict() if dist.get_rank() == 0 else None
    if dist.get_rank() != 0 or state is None:
        return None
    return {k: v.detach().to("cpu").clone() for k, v in state.items()}


def not_finite(state: dict[str, torch.Tensor]) -> str | None:
    """Which tensors of `state` are not finite, as a message; None when all are."""
    bad = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    more = f" and {len(bad) - 3} more tensors" if len(bad) > 3 else ""
    return f"the weights are not finite (NaN or inf) in {', '.join(bad[:3])}{more}" if bad else None


def beyond_dtype(model: torch.nn.Module, dtype_name: str) -> tuple[str, float] | None:
    """(name, largest magnitude) of the first tensor not finite once cast to `dtype_name`; None when all are."""
    dtype = getattr(torch, dtype_name)
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and tensor.dtype != dtype and not bool(torch.isfinite(tensor.to(dtype)).all()):
            return name, float(tensor.detach().abs().max())
    return None


def fitting_dtype(model: torch.nn.Module, spec: ExportSpec, dtype_name: str, why: str) -> tuple[str, str]:
    """(dtype, why): `dtype_name` if every weight fits, else float32 under auto; an asked dtype is refused."""
    found = beyond_dtype(model, dtype_name)
    if found is None:
        return dtype_name, why
    name, largest = found
    limit = f"{torch.finfo(getattr(torch, dtype_name)).max:.6g}"
    if spec.dtype == "auto":
        return "float32", f"{why}; but {name} reaches {largest:.6g}, beyond {dtype_name}'s largest ({limit}): float32"
    raise RunFailed(
        f"export: {spec.dtype_key}={spec.dtype} cannot hold the weights: {name} reaches {largest:.6g}, beyond "
        f"{dtype_name}'s largest ({limit}), and would be written as inf; nothing was exported. Export in bf16 or "
        f"fp32 ({spec.dtype_key}=bf16; a checkpoint: python -m ds_exp.export CHECKPOINT --dtype bf16)"
    )


def export_dtype(spec: ExportSpec, base_trained: bool) -> tuple[str, str]:
    """(torch dtype name, why) of the exported weights."""
    if spec.dtype != "auto":
        return DTYPES[spec.dtype], f"train.export_dtype={spec.dtype}"
    trained_in = DTYPES[spec.precision]
    if spec.base_path is None:
        return trained_in, f"built from a config: its weights exist only as the engine's {spec.precision} copy"
    if base_trained and spec.precision != "fp32":
        return trained_in, f"every base weight was trained in {spec.precision}: no more precise copy exists"
    if base_trained:
        return spec.base_dtype, (
            f"the base checkpoint's dtype; the weights were trained in fp32 and rounded to {spec.base_dtype} once, "
            "here (train.export_dtype=fp32 keeps them whole)"
        )
    return spec.base_dtype, "the base checkpoint's dtype; weights training left unchanged are copied from it exactly"


def export_hf(
    engine: DeepSpeedEngine,
    *,
    zero_stage: int,
    spec: ExportSpec,
    tokenizer: PreTrainedTokenizerBase,
    export_dir: Path,
    save_adapter: bool,
    merged: bool = True,
) -> Path | None:
    """Collective; rank 0 writes `export_dir`. Non-finite weights are never exported (Diverged on every rank)."""
    state = gather_full_state_dict(engine, zero_stage)
    bad = broadcast(not_finite(state) if state is not None else None)
    if bad:
        raise Diverged(f"export: {bad}: the run diverged and nothing was exported to {export_dir}")
    trained = {name for name, param in engine.module.named_parameters() if param.requires_grad}
    failure = None
    if dist.get_rank() == 0:
        assert state is not None
        try:
            write_export(state, trained, spec, tokenizer, export_dir, save_adapter=save_adapter, merged=merged)
        except RunFailed as err:  # a full disk: every rank fails with rank 0's message, none waits for it
            failure = str(err)
    failure = broadcast(failure)
    if failure is not None:
        raise RunFailed(failure)
    return export_dir if dist.get_rank() == 0 else None


def write_export(
    state: dict[str, torch.Tensor],
    trained: set[str],
    spec: ExportSpec,
    tokenizer: PreTrainedTokenizerBase,
    export_dir: Path,
    *,
    save_adapter: bool = False,
    adapter_only: bool = False,
    merged: bool = True,
) -> None:
    """One process: the full `state` (`trained`: what training changed) written to `export_dir`, or the adapter."""
    merged = merged or spec.lora is None  # without LoRA the export is the model
    unset_hf_deepspeed_config()  # the CPU copy below must be a plain, unpartitioned model
    base = _base_model(spec)
    model: PreTrainedModel | PeftModel = base if spec.lora is None else wrap_lora(base, spec.lora)
    if spec.lora is not None and spec.lora.quantize:  # the engine's base is 4/8-bit: only what was trained is taken
        state = {name: value for name, value in state.items() if name in trained}
    # weights training never changed keep the base checkpoint's exact values; the rest come from the engine
    from_base = [n for n, _ in model.named_parameters() if "lora_" not in n] if spec.base_path else []
    keep_base = set(from_base) - trained
    missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if k not in keep_base}, strict=False)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))  # lm_head.weight: not in a tied model's state
    missing = [k for k in missing if k not in keep_base and not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise RuntimeError(f"export: state dict does not fit the model: missing {missing}, unexpected {unexpected}")
    _copy_added_rows(model, state, spec)
    dtype_name, why = export_dtype(spec, base_trained=bool(set(from_base) & trained))
    tmp = export_dir.with_name(f".{export_dir.name}.tmp")
    adapter_tmp = export_dir.with_name(f".{export_dir.name}_adapter.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    needed = state_bytes(model, dtype_name)
    metadata = {
        "dtype": dtype_name,
        "why": why,
        "trained_in": spec.precision,
        "base_model": spec.base_path,
        "vocab_size": spec.vocab_size,
        "lora": None if spec.lora is None else {"merged": True, **spec.lora.describe()},
        "weights_copied_from_base": len(keep_base),
        "generation": {"template": spec.template, "stop_token_ids": list(spec.stop_token_ids)},
        "origin": spec.origin,
    }
    try:
        if spec.lora is not None and (save_adapter or adapter_only or not merged):
            target = export_dir if adapter_only else adapter_dir(export_dir)
            _save_adapter(model, spec, tokenizer, adapter_tmp, target, metadata)
            log.info("exported the LoRA adapter to %s (float32, PEFT)", target)
        if merged and not adapter_only:
            whole = merge_lora(model) if isinstance(model, PeftModel) else model
            _save(whole, spec, tokenizer, tmp, export_dir, dtype_name, metadata)
    except Exception as err:
        # nothing half-written stays: the temporary directories go, an earlier export stays as it was
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(adapter_tmp, ignore_errors=True)
        if isinstance(err, RunFailed):  # a refusal of ds_exp's own (fitting_dtype): its message says it all
            raise
        message = export_failure_message(err, export_dir, needed)
        if message is None:
            raise

        raise RunFailed(message) from err
    if merged and not adapter_only:
        log.info("exported Hugging Face model to %s (%s: %s)", export_dir, metadata["dtype"], metadata["why"])


def state_bytes(model: torch.nn.Module, dtype_name: str) -> int:
    """About what the exported weights take on disk in `dtype_name` (LoRA's adapters merged away)."""
    size = torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
    merged_away = ("lora_", ".original_module.")  # adapters, and the originals of modules trained whole
    return sum(p.numel() for name, p in model.named_parameters() if not any(m in name for m in merged_away)) * size


def _save_adapter(
    model: PreTrainedModel | PeftModel,
    spec: ExportSpec,
    tokenizer: PreTrainedTokenizerBase,
    tmp: Path,
    target: Path,
    metadata: dict[str, Any],
) -> None:
    """The PEFT adapter alone (in fp32, as trained), with the tokenizer and the metadata, moved into `target`."""
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    _save_tokenizer(spec, tokenizer, tmp)
    lora = {**metadata["lora"], "merged": False}
    (tmp / METADATA).write_text(json_text({**metadata, "dtype": "float32", "lora": lora}, indent=2) + "\n")
    _replace(tmp, target)


def _save(
    model: PreTrainedModel,
    spec: ExportSpec,
    tokenizer: PreTrainedTokenizerBase,
    tmp: Path,
    export_dir: Path,
    dtype_name: str,
    metadata: dict[str, Any],
) -> None:
    """Write the export into `tmp`, then move it into place (a LoRA model comes merged in fp32, rounded once here)."""
    if model.get_input_embeddings().num_embeddings != spec.vocab_size:
        model.resize_token_embeddings(spec.vocab_size)  # drop the padding rows: model and tokenizer agree
    # checked on what is written: cast to the export's dtype, every weight must still be finite
    dtype_name, metadata["why"] = fitting_dtype(model, spec, dtype_name, metadata["why"])
    metadata["dtype"] = dtype_name
    model.to(getattr(torch, dtype_name))
    model.config.dtype = dtype_name
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer_note = _save_tokenizer(spec, tokenizer, tmp)
    if spec.base_path is not None and (Path(spec.base_path) / "generation_config.json").is_file():
        shutil.copy2(Path(spec.base_path) / "generation_config.json", tmp / "generation_config.json")
    (tmp / METADATA).write_text(json_text({**metadata, "tokenizer": tokenizer_note}, indent=2) + "\n")
    _replace(tmp, export_dir)


def _base_model(spec: ExportSpec) -> PreTrainedModel:
    """A CPU fp32 copy of the model with the padded vocabulary: the base checkpoint's weights, or a fresh build."""
    if spec.base_path is None:
        return spec.auto_class.from_config(spec.model_config, dtype=torch.float32)
    config = copy.deepcopy(spec.model_config)
    text_config(config).vocab_size = spec.base_rows  # the checkpoint's shape; padded again below
    model = spec.auto_class.from_pretrained(
        spec.base_path, config=config, dtype=torch.float32, trust_remote_code=spec.trust_remote_code
    )
    padded = text_config(spec.model_config).vocab_size
    if model.get_input_embeddings().num_embeddings != padded:
        model.resize_token_embeddings(padded)
    return model


def _copy_added_rows(model: Any, state: dict[str, torch.Tensor], spec: ExportSpec) -> None:
    """Embedding rows of tokens the run added are not in the base checkpoint: the engine's, as the run used them."""
    if spec.base_path is None or spec.vocab_size <= spec.base_rows:
        return
    names = {id(param): name for name, param in model.named_parameters()}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is None or id(module.weight) not in names:
            continue
        trained_value = state.get(names[id(module.weight)])
        if trained_value is not None:
            with torch.no_grad():
                module.weight[spec.base_rows : spec.vocab_size] = trained_value[spec.base_rows : spec.vocab_size]


def _save_tokenizer(spec: ExportSpec, tokenizer: PreTrainedTokenizerBase, directory: Path) -> str:
    """The base tokenizer's files copied byte for byte if the run used it unchanged; else saved anew."""
    source = Path(spec.tokenizer_source)
    files = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
    if files:
        original = AutoTokenizer.from_pretrained(str(source), trust_remote_code=spec.trust_remote_code)
        if len(original) == len(tokenizer):
            for file in files:
                shutil.copy2(file, directory / file.name)
            return f"copied from {source}"
    tokenizer.save_pretrained(str(directory))
    return "saved by ds_exp: the run added tokens to the base tokenizer"


def _replace(src: Path, dst: Path) -> None:
    check_target(dst, adapter=False)
    if dst.exists():
        shutil.rmtree(dst)
    src.rename(dst)


def export_checkpoint(
    tag_dir: Path, run_dir: Path, cfg: Config, target: Path, *, dtype: str | None, adapter: bool, **beside: bool
) -> None:
    """Export the complete checkpoint `tag_dir` of the run in `run_dir` to `target` (`beside`: write_export's)."""
    hf_logging.disable_progress_bar()
    marker = read_marker(tag_dir)
    settings = marker.get("settings") or {}
    precision = str(settings.get("precision") or "fp32")
    cfg = rebuild_config(cfg)
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    ds_config = {"zero_optimization": {"stage": 0}, **{k: {"enabled": precision == k} for k in ("bf16", "fp16")}}
    built = build_model(cfg, tokenizer, ds_config)
    # the frozen weights it left out
    built_base(cfg.model, cfg.train.seed, built.model, zero3=False, checkpoint=tag_dir, what="export")
    dtype_of_training = getattr(torch, DTYPES[precision])
    state = read_weights(tag_dir, dtype_of_training)
    try:
        load_trained(state, built.model)  # the frozen weights may be left out: they are the ones rebuilt
    except RuntimeError as err:
        problem = " ".join(str(err).split())[:400]
        raise RunFailed(
            f"{tag_dir} does not fit the model the run's config builds ({problem}); was {run_dir}/.hydra changed "
            "since the checkpoint was written?"
        ) from None
    # what the checkpoint left out, as the engine held it: the rebuilt frozen weights in the training precision
    for name, value in built.model.state_dict().items():
        if name not in state:
            state[name] = value.to(dtype_of_training) if value.is_floating_point() else value
    bad = not_finite(state)
    if bad:
        raise Diverged(f"{tag_dir}: {bad}: that checkpoint diverged and nothing was exported; export an earlier one")
    trained = {name for name, param in built.model.named_parameters() if param.requires_grad}
    spec = export_spec(
        cfg.model,
        built,
        precision,
        dtype=dtype or str(plain(cfg.train.export_dtype)),
        dtype_key="--dtype" if dtype else "train.export_dtype",
        template=run_template(cfg.data, marker, tokenizer),
        stop_token_ids=tuple(stop_token_ids(tokenizer, cfg.data.end_of_conversation_token)),
        origin={
            "written_by": WRITTEN_BY,
            "checkpoint": str(tag_dir.resolve()),
            "step": int(marker["step"]),
            "run_dir": str(run_dir.resolve()),
        },
    )
    del built  # the export builds its own copy: one model in memory at a time, besides the state
    write_export(state, trained, spec, tokenizer, target, adapter_only=adapter, **beside)


def rebuild_config(cfg: Config, *, base: bool = False) -> Config:
    """The run's config for a rebuild in this process, without what changes no weight (kernels, compile, SP)."""
    cfg = dataclasses.replace(cfg)
    sp = int(cfg.dist.sequence_parallel_size)
    cfg.dist = dataclasses.replace(cfg.dist, sequence_parallel_size=1)
    model: dict[str, Any] = {"liger_kernel": False, "fused_loss": False}
    cfg.train = dataclasses.replace(cfg.train, compile=False)
    if cfg.model.attn_implementation == "auto":
        model["attn_implementation"] = None  # flash-attention needs a GPU; the weights do not depend on it
    if sp > 1 and model.get("attn_implementation", cfg.model.attn_implementation) is None:
        model["attn_implementation"] = "sdpa"  # what the run's model was built with (ds_exp.model.build)
    if base:
        cfg.lora = dataclasses.replace(cfg.lora, dim=0, quantize=None)
        off = ("gradient_checkpointing", "tiled_mlp", "tiled_loss", "activation_offload")
        model |= dict.fromkeys(off, False)
    cfg.model = dataclasses.replace(cfg.model, **model)
    return cfg


def read_weights(tag_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full state dict of the module at the checkpoint, in the training precision `dtype`."""
    try:
        with compat.torch_load_weights_only(list(CHECKPOINT_TYPES)):
            states = tag_dir / MODEL_STATES[0]
            if states.is_file():  # ZeRO 0-2: the whole module, as the engine held it
                return dict(torch.load(states, map_location="cpu")["module"])
            quiet = io.StringIO()  # zero_to_fp32 prints and draws progress bars
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:  # a file truncated or deleted since
        first = first_line(err)
        raise RunFailed(
            f"{tag_dir} cannot be read, a file of it is damaged or missing ({first}); export an earlier checkpoint"
        ) from None
    # the engine's ZeRO-3 parameters are these fp32 masters rounded to the training precision
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}


def run_template(data: DataConfig, marker: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> str:
    """The template the run asked its model in: its tokenized data's, else data.template for the tokenizer."""
    key = (marker.get("trajectory") or {}).get("data")
    meta = read_meta(data_cache_dir(data.cache_dir) / str(key)) if key else None
    stats = (meta or {}).get("stats") or {}
    return first_template(stats) if stats.get("template") else resolve_template(data.template, tokenizer)
