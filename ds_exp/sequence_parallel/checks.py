"""Checks of dist.sequence_parallel_size before anything heavy (light). A hub model's heads are checked once its
config is loaded (ulysses.check_heads), still before data and weights."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from ds_exp.config.features import CheckFacts
from ds_exp.sequence_parallel.settings import SequenceParallelSettings

MIN_DEEPSPEED = (0, 17)  # Ulysses for Hugging Face models (deepspeed.runtime.sequence_parallel.ulysses_sp) came in 0.17
# attention implementations that keep packed documents apart under Ulysses: ds_exp runs them per document
# (ds_exp/sequence_parallel/ulysses.py). Not flex_attention: DeepSpeed rebuilds its BlockMask as plain causal over
# the row.
ISOLATING_PACKED = (None, "auto", "sdpa", "flash_attention_2", "flash_attention_3")


def head_problems(n: int, heads: object, kv_heads: object, where: str) -> list[str]:
    """Heads must split over the N ranks (Ulysses moves whole heads); key/value heads split too, or divide N."""
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


def sequence_parallel_problems(settings: SequenceParallelSettings, world_size: int | None) -> list[str]:
    """One line per problem with dist.sequence_parallel_size; `world_size` None when the launch is not known yet."""
    n = settings.size
    key = f"dist.sequence_parallel_size={n}"
    if n <= 1:  # off (below 1: its range says so)
        return []
    problems = []
    if world_size is not None and world_size % n:
        problems.append(
            f"{key} does not divide the world size {world_size}: the ranks form groups of {n}, each training its "
            f"samples together; launch a multiple of {n} ranks (e.g. torchrun --nproc_per_node {n}) or set "
            f"dist.sequence_parallel_size to a divisor of {world_size}"
        )
    attention = settings.attention
    if attention == "eager":
        problems.append(
            f"model.attn_implementation=eager cannot run under {key}: it needs the full 4D attention mask, which "
            "Ulysses does not carry; use model.attn_implementation=sdpa (or flash_attention_2 on GPUs)"
        )
    if settings.packing and attention != "eager" and attention not in ISOLATING_PACKED:
        problems.append(
            f"data.packing=true with model.attn_implementation={attention} under {key}: packed documents would attend "
            "to each other (DeepSpeed's Ulysses wrapper gives this attention a plain causal mask over the whole row); "
            "use model.attn_implementation=sdpa or flash_attention_2, which ds_exp runs per document, or "
            "data.packing=false"
        )
    micro, eval_micro = settings.micro_batch_size, settings.eval_micro_batch_size
    if eval_micro is not None and eval_micro != micro:
        problems.append(
            f"train.eval_micro_batch_size={eval_micro} under {key}: DeepSpeed's Ulysses attention is built for one "
            f"batch size (train.micro_batch_size={micro}) and evaluation runs through it; set "
            "train.eval_micro_batch_size=null"
        )
    if settings.model:  # a multimodal config's text part has the heads
        text = settings.model.get("text_config")
        text = text if isinstance(text, dict) and "num_attention_heads" in text else settings.model
        problems += head_problems(
            n, text.get("num_attention_heads"), text.get("num_key_value_heads"), settings.model_from
        )
    problem = deepspeed_problem()
    if problem is not None:
        problems.append(problem)
    return problems


def zero_problems(settings: SequenceParallelSettings, facts: CheckFacts) -> list[str]:
    """ZeRO settings that sequence parallelism cannot train exactly with (in the merged DeepSpeed config)."""
    n = settings.size
    zero = facts.ds_config.get("zero_optimization") or {}
    # an optimizer that needs it off (Muon) has its own line: ds_exp/config/optimizer_checks.py
    optimizer_set_it = "zero_optimization.reduce_scatter" in facts.optimizer_keys
    if n > 1 and zero.get("stage") == 3 and zero.get("reduce_scatter") is False and not optimizer_set_it:
        return [
            f"zero.reduce_scatter=false with dist.sequence_parallel_size={n} at ZeRO-3: DeepSpeed 0.19.8 averages "
            "ZeRO-3 gradients over sequence-parallel ranks differently on its all-reduce and reduce-scatter paths "
            "(ds_exp/core/compat/), and with reduce_scatter off it picks one per bucket; leave zero.reduce_scatter "
            "unset (or true)"
        ]
    return []
