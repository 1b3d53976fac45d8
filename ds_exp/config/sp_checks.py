"""Checks of dist.sequence_parallel_size (Ulysses sequence parallelism) before anything heavy: light, no torch, no
deepspeed. The model's heads are read from model.arch or a local config.json (`model_settings`); a hub model's are
checked again once its config is loaded (ds_exp.model.sequence_parallel.check_heads), still before data and weights.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

from ds_exp.config.ds_config import optimizer_needs
from ds_exp.config.model_checks import model_settings
from ds_exp.config.schema import Config

MIN_DEEPSPEED = (0, 17)  # Ulysses for Hugging Face models (deepspeed.runtime.sequence_parallel.ulysses_sp) came in 0.17
# attention implementations that keep packed documents apart under Ulysses: ds_exp runs them per document
# (ds_exp/model/sequence_parallel.py). Not flex_attention: DeepSpeed rebuilds its BlockMask as plain causal over the
# row.
ISOLATING_PACKED = (None, "auto", "sdpa", "flash_attention_2", "flash_attention_3")


def sp_size(cfg: Config) -> int:
    return int(cfg.dist.sequence_parallel_size)


def text_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's text part (where its attention heads are), else the config itself."""
    text = settings.get("text_config")
    return text if isinstance(text, dict) and "num_attention_heads" in text else settings


def head_problems(n: int, heads: object, kv_heads: object, where: str) -> list[str]:
    """Attention heads must split over the N ranks (Ulysses moves whole heads); key/value heads either split too, or
    divide N (DeepSpeed then replicates each over N / kv ranks)."""
    key = f"dist.sequence_parallel_size={n}"
    if not isinstance(heads, int) or heads < 1:
        return []
    if heads % n:
        fits = [d for d in range(2, heads + 1) if heads % d == 0]
        return [
            f"{key} does not divide the model's {heads} attention heads ({where}): Ulysses gives each rank whole "
            f"heads; use a sequence_parallel_size that divides {heads} ({', '.join(map(str, fits)) or 'none > 1'})"
        ]
    kv = kv_heads if isinstance(kv_heads, int) and kv_heads >= 1 else heads
    if kv % n and n % kv:
        return [
            f"{key} and the model's {kv} key/value heads ({where}) do not divide one another: Ulysses splits key/value "
            f"heads over the ranks, or replicates each when their number divides N; use a sequence_parallel_size "
            f"that {kv} divides or that divides {kv}"
        ]
    return []


def deepspeed_problem() -> str | None:
    """DeepSpeed's Ulysses module is there (found without importing deepspeed)."""
    key = "dist.sequence_parallel_size"
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return f"{key} > 1 needs DeepSpeed >= 0.17 (pip install 'deepspeed>=0.17')"
    parts = tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[:2])
    spec = importlib.util.find_spec("deepspeed")
    module = Path(spec.origin).parent / "runtime/sequence_parallel/ulysses_sp.py" if spec and spec.origin else None
    if parts < MIN_DEEPSPEED or module is None or not module.is_file():
        return (
            f"{key} > 1 needs DeepSpeed's Ulysses sequence parallelism (deepspeed.runtime.sequence_parallel."
            f"ulysses_sp, DeepSpeed 0.17 or newer); this is DeepSpeed {version}: pip install -U 'deepspeed>=0.17'"
        )
    return None


def sequence_parallel_problems(cfg: Config, world_size: int | None) -> list[str]:
    """One line per problem with dist.sequence_parallel_size; `world_size` None when the launch is not known yet."""
    n = sp_size(cfg)
    key = f"dist.sequence_parallel_size={n}"
    if n < 1:
        return [f"{key}: must be >= 1 (1 = off; N > 1 shards every sample's sequence over N ranks)"]
    if n == 1:
        return []
    problems = []
    if world_size is not None and world_size % n:
        problems.append(
            f"{key} does not divide the world size {world_size}: the ranks form groups of {n}, each training its "
            f"samples together; launch a multiple of {n} ranks (e.g. torchrun --nproc_per_node {n}) or set "
            f"dist.sequence_parallel_size to a divisor of {world_size}"
        )
    attention = cfg.model.attn_implementation
    if attention == "eager":
        problems.append(
            f"model.attn_implementation=eager cannot run under {key}: it needs the full 4D attention mask, which "
            "Ulysses does not carry; use model.attn_implementation=sdpa (or flash_attention_2 on GPUs)"
        )
    if cfg.data.packing and attention != "eager" and attention not in ISOLATING_PACKED:
        problems.append(
            f"data.packing=true with model.attn_implementation={attention} under {key}: packed documents would attend "
            "to each other (DeepSpeed's Ulysses wrapper gives this attention a plain causal mask over the whole row); "
            "use model.attn_implementation=sdpa or flash_attention_2, which ds_exp runs per document, or "
            "data.packing=false"
        )
    train = cfg.train
    if train.eval_micro_batch_size is not None and train.eval_micro_batch_size != train.micro_batch_size:
        problems.append(
            f"train.eval_micro_batch_size={train.eval_micro_batch_size} under {key}: DeepSpeed's Ulysses attention is "
            f"built for one batch size (train.micro_batch_size={train.micro_batch_size}) and evaluation runs through "
            "it; set train.eval_micro_batch_size=null"
        )
    settings = model_settings(cfg.model)
    if settings:
        text = text_settings(settings)
        where = "model.arch" if cfg.model.name_or_path is None else "its config.json"
        problems += head_problems(n, text.get("num_attention_heads"), text.get("num_key_value_heads"), where)
    problem = deepspeed_problem()
    if problem is not None:
        problems.append(problem)
    return problems


def zero_problems(cfg: Config, ds: dict[str, Any]) -> list[str]:
    """ZeRO settings that sequence parallelism cannot train exactly with (ds: the merged DeepSpeed config)."""
    n = sp_size(cfg)
    zero = ds.get("zero_optimization") or {}
    # an optimizer that needs it off (Muon) has its own line: ds_exp/config/optimizer_checks.py
    optimizer_set_it = any(
        path == "zero_optimization.reduce_scatter" for path, *_ in optimizer_needs(cfg.optimizer, ds)
    )
    if n > 1 and zero.get("stage") == 3 and zero.get("reduce_scatter") is False and not optimizer_set_it:
        return [
            f"zero.reduce_scatter=false with dist.sequence_parallel_size={n} at ZeRO-3: DeepSpeed 0.19.8 averages "
            "ZeRO-3 gradients over sequence-parallel ranks differently on its all-reduce and reduce-scatter paths "
            "(ds_exp/core/compat/), and with reduce_scatter off it picks one per bucket; leave zero.reduce_scatter "
            "unset (or true)"
        ]
    return []
