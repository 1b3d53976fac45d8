"""Ulysses at the model build's points: DeepSpeed's `UlyssesSPAttentionHF` makes the groups (the mpu) of dp x N
contiguous ranks and all-to-alls sequence to head shards. A group's ranks draw the same rows and `SequenceShard` keeps
each one's slice; packed rows attend per document; generation runs unsharded."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from peft import PeftModel
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ds_exp.core import compat
from ds_exp.core.errors import ConfigError
from ds_exp.model.architecture import text_config
from ds_exp.model.head_loss import IGNORE_INDEX
from ds_exp.model.hooks import ModelBuild, ModelHooks
from ds_exp.sequence_parallel.checks import head_problems, sequence_parallel_problems
from ds_exp.sequence_parallel.settings import SequenceParallelSettings
from ds_exp.train.hooks import FeatureHooks, Run

# a transformers attention function (ALL_ATTENTION_FUNCTIONS): (module, query, key, value, mask, ...) -> (out, weights)
AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class SequenceShard:
    """This rank's slice of each collated batch (its place: rank % size; DeepSpeed's groups are contiguous)."""

    size: int
    rank: int

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`shift_labels` from the whole row, and every [rows, length] tensor cut along the sequence. No mask:
        DeepSpeed's wrapper takes causality from position_ids, and right padding sits behind every real token."""
        width = batch["input_ids"].size(1)
        if width % self.size:
            raise ValueError(f"a batch of length {width} does not split over {self.size} ranks (collate to a multiple)")
        chunk = width // self.size
        full = {k: v for k, v in batch.items() if k not in ("labels", "attention_mask")}
        full["shift_labels"] = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
        part = slice(self.rank * chunk, (self.rank + 1) * chunk)
        return {k: v[:, part].contiguous() for k, v in full.items()}


def check_heads(config: PretrainedConfig, size: int) -> None:
    """The model's heads split over the group (for a model whose config validation could not read: a hub id)."""
    text = text_config(config)
    problems = head_problems(
        size, getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None), "its config"
    )
    if problems:
        raise ConfigError(problems)


def isolate_documents(core: AttentionFunction) -> AttentionFunction:
    """`core` run per document where position_ids restart: under Ulysses no mask reaches it to keep documents apart."""

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = kwargs.get("position_ids")
        length = query.size(2)
        if positions is None or length == 1 or positions.size(-1) != length:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        starts = positions[:, 1:] != positions[:, :-1] + 1  # a document begins where the count does not go on
        if not bool(starts.any()):
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        rows = []
        for row in range(query.size(0)):
            cuts = [0, *(torch.nonzero(starts[row]).flatten() + 1).tolist(), length]
            pieces = []
            for a, b in itertools.pairwise(cuts):
                one = slice(row, row + 1)
                out, _ = core(
                    module,
                    query[one, :, a:b],
                    key[one, :, a:b],
                    value[one, :, a:b],
                    None,
                    *args,
                    **{**kwargs, "position_ids": positions[one, a:b]},
                )
                pieces.append(out)  # [1, document length, heads, head size]
            rows.append(torch.cat(pieces, dim=1))
        return torch.cat(rows, dim=0), None

    return attention


class _Registration:
    """What `register` changed in transformers' attention table, for generation and a later run to undo."""

    def __init__(self, key: str, original: AttentionFunction, sharded: AttentionFunction) -> None:
        self.key, self.original, self.sharded = key, original, sharded
        self.paused = False

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return (self.original if self.paused else self.sharded)(*args, **kwargs)


_registered: _Registration | None = None


def register(model_config: PretrainedConfig, attention: str, size: int, micro_batch_size: int) -> ModuleType:
    """Collective: DeepSpeed's Ulysses attention for `attention`, before the model is built; returns the mpu."""
    global _registered

    unregister()
    original = ALL_ATTENTION_FUNCTIONS[attention]
    ALL_ATTENTION_FUNCTIONS[attention] = isolate_documents(original)  # the core function DeepSpeed wraps
    holder = SimpleNamespace(config=model_config)  # the model is not built yet: DeepSpeed reads only `.config`
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            holder,
            core_attn_implementation=attention,
            sequence_parallel_size=size,
            micro_batch_size=micro_batch_size,
            seq_length_is_variable=True,
        )
    except ValueError as err:  # heads, or an attention its wrapper does not take
        ALL_ATTENTION_FUNCTIONS[attention] = original
        raise ConfigError(f"dist.sequence_parallel_size={size}: DeepSpeed's Ulysses refuses it: {err}") from None
    _registered = _Registration(attention, original, ALL_ATTENTION_FUNCTIONS[attention])
    ALL_ATTENTION_FUNCTIONS[attention] = _registered
    return mpu


def unregister() -> None:
    """The attention table as it was and DeepSpeed's groups released, so a later run registers afresh."""
    global _registered
    if _registered is None:
        return

    ALL_ATTENTION_FUNCTIONS[_registered.key] = _registered.original
    _registered = None
    compat.release_sequence_parallel_groups()


class SequenceParallelHooks(FeatureHooks, ModelHooks):
    settings: SequenceParallelSettings

    def after_model_config(self, run: Run, model_config: PretrainedConfig) -> None:
        problems = sequence_parallel_problems(self.settings, run.session.world)  # the world the group has (submitit)
        if problems:
            raise ConfigError(problems)
        check_heads(model_config, self.settings.size)  # a hub model's, before its data and weights

    def before_weights(self, build: ModelBuild) -> None:
        build.attention = build.attention or "sdpa"  # the wrapper needs the name of the attention it wraps
        size = self.settings.size
        build.mpu = register(build.config, build.attention, size, self.settings.micro_batch_size)
        build.shard = SequenceShard(size, dist.get_rank() % size)

    def after_wrap(self, model: PreTrainedModel | PeftModel, build: ModelBuild) -> None:
        attention, config = build.attention or "sdpa", text_config(model.config)
        actual = getattr(config, "_attn_implementation", None)
        if actual is not None and actual != attention:  # transformers fell back to another
            raise ConfigError(
                f"dist.sequence_parallel_size > 1 wraps {attention} attention, but this model runs {actual}: set "
                f"model.attn_implementation={attention} if the model supports it (sdpa or flash_attention_2)"
            )
        generate, registration = model.generate, _registered
        assert callable(generate) and registration is not None

        def unsharded(*args: Any, **kwargs: Any) -> Any:
            registration.paused = True  # generation: every rank runs whole sequences
            try:
                return generate(*args, **kwargs)
            finally:
                registration.paused = False

        model.generate = unsharded  # type: ignore[method-assign]  # this model's own, as the losses patch lm_head

    def after_release(self, run: Run) -> None:
        unregister()  # transformers' attention table as it was, for a later run of this process
