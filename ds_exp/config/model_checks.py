"""Cheap checks of the model's own files, read with json (never transformers): a config.json that parses, weights
that are complete, and data.max_seq_len within a learned position table (past it: an IndexError deep in forward)."""

from __future__ import annotations

import json
import math
import os
import re
from importlib.metadata import version
from pathlib import Path
from typing import Any

from ds_exp.config.schema import EvalConfig, ModelConfig
from ds_exp.core.errors import ConfigError

WEIGHT_FILES = tuple(
    f"{name}{index}" for name in ("model.safetensors", "pytorch_model.bin") for index in ("", ".index.json")
)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")
# Keys that only rotary position embeddings have (transformers 4 and 5 spellings).
ROPE_KEYS = (
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rotary_dim",
    "rotary_emb_base",
    "partial_rotary_factor",
    "rotary_pct",
)
# model_type families, for configs that do not spell their position encoding out
ROPE_TYPES = frozenset(
    (
        *("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text"),
        *("phi", "phi3", "phimoe", "gptj", "gpt_neox", "codegen", "stablelm", "starcoder2", "olmo", "olmo2", "olmoe"),
        *("cohere", "cohere2", "granite", "granitemoe", "deepseek_v2", "deepseek_v3", "glm", "glm4", "smollm3"),
        *("persimmon", "falcon", "nemotron", "helium", "ernie4_5", "internlm2", "baichuan", "exaone"),
    )
)
# Learned (or fixed-size sinusoidal) tables of absolute positions: a position past the end is an IndexError.
LEARNED_TYPES = frozenset(
    (
        *("opt", "gpt2", "gpt_neo", "gpt_bigcode", "openai-gpt", "biogpt", "ctrl", "imagegpt", "bert", "roberta"),
        *("xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert"),
        *("rembert", "roc_bert", "bert-generation", "roberta-prelayernorm", "bart", "mbart", "plbart", "marian"),
        *("blenderbot", "blenderbot-small", "pegasus", "trocr", "xmod", "big_bird", "bigbird_pegasus", "git", "mvp"),
        *("prophetnet", "xlm", "roformer", "reformer"),
    )
)
# ALiBi, relative or no positions (state-space hybrids), or a sinusoidal table that grows: nothing to run past
UNLIMITED_TYPES = frozenset(("bloom", "mpt", "xlnet", "xglm", "jamba", "zamba", "nemotron_h"))
PADDING_OFFSET = {t: 2 for t in ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "xmod")}


def looks_like_local_path(name: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else path-shaped is meant as a local directory."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.path.exists(name)


def local_checkpoint(model: ModelConfig) -> Path | None:
    """model.name_or_path as a directory on this machine; None for a hub id, a missing path or a built model."""
    value = model.name_or_path
    if value is None or not looks_like_local_path(value):
        return None
    path = Path(value).expanduser()
    return path if path.is_dir() else None


def read_config_json(directory: Path, shown: str, key: str | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """(config.json as a dict, None) or (None, the problem in one line naming model.name_or_path or `key`)."""
    key = key or f"model.name_or_path={shown}"
    try:
        value = json.loads((directory / "config.json").read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None, None  # reported by the caller, with the directory's other checks
    except UnicodeDecodeError as err:
        return None, f"{key}: config.json is not UTF-8 text ({err.reason} at byte {err.start}); fix or replace the file"
    except json.JSONDecodeError as err:
        where = f"line {err.lineno} column {err.colno}: {err.msg}"
        return None, f"{key}: config.json is not valid JSON ({where}); fix or replace the file"
    if not isinstance(value, dict):
        kind = type(value).__name__
        return None, f"{key}: config.json holds a JSON {kind}, not an object; fix or replace the file"
    return value, None


def _cut_short(path: Path) -> str | None:
    """Why a weights file cannot be complete, from its size and (safetensors) header; None when it looks whole."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if head.startswith(b"version "):
            return "is a Git LFS pointer, not the weights; run `git lfs pull` in the checkpoint directory"
        if path.suffix != ".safetensors":
            return "is empty" if size == 0 else None
        header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
        if header_len < 2 or 8 + header_len > size:
            return f"is cut short or not a safetensors file ({size} bytes, no complete header)"
        try:
            header = json.loads(fh.read(header_len))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "is not a safetensors file (its header is not readable)"
    if 8 + header_len + end > size:
        return f"is cut short ({size} of the {8 + header_len + end} bytes its header lists)"
    return None


def weights_problem(directory: Path, shown: str, key: str | None = None) -> str | None:
    """One line naming model.name_or_path (or `key`) when the weights are missing or incomplete."""
    key = key or f"model.name_or_path={shown}"
    present = [name for name in WEIGHT_FILES if (directory / name).is_file()]
    if not present:
        if (directory / "adapter_config.json").is_file():
            return (
                f"{key} holds a PEFT adapter (adapter_config.json), not a whole model; point model.name_or_path at "
                "the base model (or merge the adapter into it first)"
            )
        return (
            f"{key}: no weights file ({', '.join(WEIGHT_FILES)}) in {directory}; copy the checkpoint's weights "
            "there (or use model.arch to train a model built from a config)"
        )
    files = [directory / present[0]]
    if present[0].endswith(".index.json"):
        try:
            weight_map = json.loads((directory / present[0]).read_text(encoding="utf-8"))["weight_map"]
            files = [directory / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError) as err:
            return f"{key}: {present[0]} is not a readable index ({err}); download or copy it again"
    for path in files:
        if not path.is_file():
            return f"{key}: {path.name} is missing ({present[0]} lists it); download or copy it again"
        why = _cut_short(path)
        if why is not None:
            return f"{key}: {path.name} {why}" + ("" if "git lfs" in why else "; download or copy it again")
    return None


def local_model_problems(model: ModelConfig, *, dry_run: bool) -> list[str]:
    """A local model.name_or_path: config.json parses, and (unless it is a dry run) the weights are complete."""
    directory = local_checkpoint(model)
    if directory is None or not (directory / "config.json").is_file():
        return []
    _, problem = read_config_json(directory, str(model.name_or_path))
    if problem is not None:
        return [problem]
    if dry_run:  # a dry run reads the config only: planning a model whose weights are elsewhere is fine
        return []
    problem = weights_problem(directory, str(model.name_or_path))
    return [problem] if problem else []


def model_settings(model: ModelConfig) -> dict[str, Any] | None:
    """The model's config as a dict: its config.json, or model.arch; None when neither is readable here."""
    if model.name_or_path is None:
        return dict(model.arch) if model.arch is not None else None
    directory = local_checkpoint(model)
    return read_config_json(directory, model.name_or_path)[0] if directory is not None else None


def position_limit(settings: dict[str, Any]) -> tuple[str, int, str] | None:
    """(config key, positions the model has, "learned" | "rope" | "unknown"); None when nothing limits them."""
    text = settings.get("text_config")
    chosen = text if isinstance(text, dict) and any(k in text for k in POSITION_KEYS) else settings
    model_type = str(chosen.get("model_type") or settings.get("model_type") or "")
    found = chosen.get("attn_config")
    attn: dict[str, Any] = found if isinstance(found, dict) else {}
    if model_type in UNLIMITED_TYPES or chosen.get("alibi") is True or attn.get("alibi") is True:
        return None
    key = next((k for k in POSITION_KEYS if isinstance(chosen.get(k), int) and chosen[k] > 0), None)
    if key is None:
        return None
    limit = int(chosen[key]) - PADDING_OFFSET.get(model_type, 0)
    if model_type in LEARNED_TYPES:
        return key, limit, "learned"
    if model_type in ROPE_TYPES or any(chosen.get(k) is not None for k in ROPE_KEYS):
        return key, limit, "rope"
    return key, limit, "unknown"


def _beyond(model: ModelConfig, max_seq_len: int) -> tuple[int, str, int, str, str] | None:
    """(max_seq_len, key, limit, kind, model_type) when data.max_seq_len is beyond the model's positions."""
    settings = model_settings(model)
    if not settings:
        return None
    found = position_limit(settings)
    if found is None or max_seq_len <= found[1]:
        return None
    return max_seq_len, found[0], found[1], found[2], str(settings.get("model_type") or "?")


def max_seq_len_problems(model: ModelConfig, max_seq_len: int) -> list[str]:
    """An error for a model with a learned position table shorter than data.max_seq_len."""
    beyond = _beyond(model, max_seq_len)
    if beyond is None or beyond[3] != "learned":
        return []
    n, key, limit, _, model_type = beyond
    return [
        f"data.max_seq_len={n} is beyond the model's {limit} positions ({model_type}, {key}={limit}; it learned a "
        f"table of absolute positions, longer inputs fail in the forward pass): set data.max_seq_len={limit} or lower"
    ]


def max_new_tokens_problems(model: ModelConfig, eval_cfg: EvalConfig) -> list[str]:
    """eval.max_new_tokens alone at or past a learned position table leaves no room for any prompt."""
    settings = model_settings(model)
    if not (eval_cfg.prompts or eval_cfg.prompts_file) or not settings:
        return []
    found = position_limit(settings)
    if found is None or found[2] != "learned" or eval_cfg.max_new_tokens < found[1]:
        return []
    key, limit, _ = found
    return [
        f"eval.max_new_tokens={eval_cfg.max_new_tokens} leaves no room for a prompt within the model's {limit} "
        f"positions ({settings.get('model_type')}, {key}={limit}: a learned table of absolute positions, generating "
        f"past it fails): set eval.max_new_tokens below {limit}, e.g. {min(64, limit // 2)}"
    ]


# what a model that changes its logits after lm_head calls it (a loss computed from lm_head's output would skip it)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def logits_changed_after_head(settings: dict[str, Any] | None) -> str | None:
    """The config key by which a model transforms its logits after lm_head (the tiled and the fused loss skip it)."""
    if not settings:
        return None
    for scope in (settings, settings.get("text_config") or {}):
        for key in LOGIT_TRANSFORMS:
            value = scope.get(key) if isinstance(scope, dict) else None
            if value not in (None, 0, 0.0, 1, 1.0, False):
                return f"{key}={value}"
    return None


def rope_scaling_override(scaling: dict[str, Any]) -> str:
    """model.rope_scaling as the command line override that sets it."""
    return "model.rope_scaling={" + ",".join(f"{k}:{v}" for k, v in scaling.items()) + "}"


def scaled_positions(scaling: dict[str, Any] | None, limit: int) -> int | None:
    """The positions model.rope_scaling stretches the context to (factor x original), None when it has no factor."""
    if not scaling or not isinstance(scaling.get("factor"), (int, float)):
        return None
    original = scaling.get("original_max_position_embeddings")
    base = int(original) if isinstance(original, int) and original > 0 else limit
    return int(float(scaling["factor"]) * base)


def max_seq_len_notes(model: ModelConfig, max_seq_len: int) -> list[str]:
    """Warnings for rotary or unknown position encodings run past the trained (or rope_scaling's) context."""
    beyond = _beyond(model, max_seq_len)
    if beyond is None or beyond[3] == "learned":
        return []
    n, key, limit, kind, model_type = beyond
    scaling = dict(model.rope_scaling or {})
    if kind == "rope":
        stretched = scaled_positions(scaling, limit)
        if scaling and (stretched is None or n <= stretched):
            return []  # the user extends the context on purpose
        factor = float(math.ceil(n / limit))
        suggestion = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": limit}
        if scaling:
            return [
                f"data.max_seq_len={n} is beyond the {stretched} positions {rope_scaling_override(scaling)} "
                f"stretches the trained context ({key}={limit}) to; raise its factor to {factor} or more"
            ]
        return [
            f"data.max_seq_len={n} is beyond the model's trained context ({key}={limit}): rotary position "
            f"embeddings run past it, but quality usually drops there; set data.max_seq_len={limit}, or extend the "
            f"context with {rope_scaling_override(suggestion)}"
        ]
    return [
        f"data.max_seq_len={n} is beyond the model's {key}={limit} ({model_type}: how it encodes positions is not "
        f"known to ds_exp); if it learned absolute positions, longer inputs fail: set data.max_seq_len={limit}"
    ]


# Sizes and counts of an architecture, in the spellings of transformers' model families: whole numbers > 0.
SIZE_KEYS = frozenset(
    (
        *("hidden_size", "n_embd", "d_model", "embed_dim", "intermediate_size", "ffn_dim", "n_inner", "d_ff"),
        *("num_hidden_layers", "n_layer", "num_layers", "num_attention_heads", "n_head", "num_heads"),
        *("num_key_value_heads", "head_dim", "max_position_embeddings", "n_positions", "n_ctx", "word_embed_proj_dim"),
    )
)
_SIZE_PATTERN = re.compile(r"^(num_\w+_(layers|heads)|\w+_(hidden|intermediate|head)_(size|dim))$")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads")
_PARTIAL_ROTARY = ("partial_rotary_factor", "rotary_pct", "rotary_dim")


def _is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _divisors(n: int) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, found[:8])) + (", ..." if len(found) > 8 else "")


def arch_problems(model: ModelConfig) -> list[str]:
    """model.arch holds an architecture transformers can build and run (sizes, head divisibility, rotary dimension,
    epsilons, dropouts): told here, not as a shape mismatch in the first forward pass."""
    arch = model.arch
    if model.name_or_path is not None or arch is None:
        return []
    problems = []
    if not arch.get("model_type"):
        problems.append("model.arch.model_type is missing: name the architecture, e.g. model.arch.model_type=llama")
    for key, value in arch.items():
        shown = f"model.arch.{key}={value}"
        if key == "vocab_size":
            if value is not None and (not _is_whole(value) or value < 0):
                problems.append(f"{shown}: must be a whole number >= 0 (0 = the tokenizer's size)")
        elif key in SIZE_KEYS or _SIZE_PATTERN.match(key):
            if value is not None and (not _is_whole(value) or value < 1):
                problems.append(f"{shown}: must be a whole number > 0 (or null for the architecture's default)")
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{shown}: must be a finite number")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if key.endswith(("_eps", "epsilon")) and value <= 0:
                problems.append(f"{shown}: must be > 0 (e.g. 1e-6)")
            elif ("dropout" in key or key.endswith("pdrop")) and not 0 <= value <= 1:
                problems.append(f"{shown}: a probability, must be in [0, 1]")
            elif key == "rope_theta" and value <= 0:
                problems.append(f"{shown}: must be > 0 (e.g. 10000)")
    if problems:
        return problems
    return _head_problems(arch)


def _head_problems(arch: dict[str, Any]) -> list[str]:
    hidden_key = next((k for k in _HIDDEN_KEYS if arch.get(k) is not None), None)
    heads_key = next((k for k in _HEAD_KEYS if arch.get(k) is not None), None)
    if hidden_key is None or heads_key is None:
        return []
    hidden, heads = arch[hidden_key], arch[heads_key]
    problems = []
    if arch.get("head_dim") is None and hidden % heads:
        problems.append(
            f"model.arch.{hidden_key}={hidden} is not a multiple of model.arch.{heads_key}={heads}: each attention "
            f"head gets {hidden_key} / {heads_key} dimensions; give {heads_key} a divisor of {hidden} "
            f"({_divisors(hidden)})"
        )
    kv_heads = arch.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        problems.append(
            f"model.arch.num_key_value_heads={kv_heads} does not divide model.arch.{heads_key}={heads}: each key/value "
            f"head serves an equal group of query heads; use one of {_divisors(heads)}"
        )
    head_dim = arch.get("head_dim") or (hidden // heads if hidden % heads == 0 else None)
    rotary = str(arch.get("model_type")) in ROPE_TYPES and not any(arch.get(k) is not None for k in _PARTIAL_ROTARY)
    if rotary and head_dim is not None and head_dim % 2:
        where, fix = (
            ("model.arch.head_dim", f"head_dim={head_dim + 1}")
            if arch.get("head_dim")
            else (f"{hidden_key} / {heads_key}", f"{hidden_key}={2 * hidden}")
        )
        problems.append(
            f"model.arch: the attention head dimension {where} = {head_dim} is odd, and rotary position embeddings "
            f"({arch.get('model_type')}) turn pairs of dimensions: make it even (e.g. model.arch.{fix})"
        )
    return problems


def checkpoint_error(model: ModelConfig, err: BaseException, *, weights: bool = False) -> ConfigError | None:
    """transformers' error loading model.name_or_path, as one message naming the file and the fix; else None."""
    directory = local_checkpoint(model)
    if directory is None:
        return None
    shown = f"model.name_or_path={model.name_or_path}"
    settings, problem = read_config_json(directory, str(model.name_or_path))
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

        return ConfigError(
            f"{shown}: config.json has model_type={model_type}, which transformers {version('transformers')} does "
            "not know; upgrade transformers (pip install -U transformers), or set model.trust_remote_code=true if "
            "the checkpoint ships its own model code"
        )
    problem = weights_problem(directory, str(model.name_or_path)) if weights else None
    return ConfigError(problem) if problem is not None else None
