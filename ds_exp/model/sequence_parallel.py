"""Ulysses sequence parallelism (`dist.sequence_parallel_size=N`), DeepSpeed's ALST, in ds_exp's exact step.

The world is dp x N ranks; DeepSpeed's groups are contiguous (ranks [i*N, (i+1)*N) train together), so a rank's place
in its group is rank % N and its data-parallel rank is rank // N. What each part does:

- DeepSpeed: `UlyssesSPAttentionHF.register_with_transformers` makes the groups (the `mpu` handed to
  deepspeed.initialize) and swaps the model's attention function for one that all-to-alls from sequence shards to
  head shards and back. ZeRO then partitions over all dp x N ranks, sums gradients over the N ranks of a group and
  divides by dp.
- ds_exp's data path (not DeepSpeed's DataLoader adapter, whose queue spills shards across optimizer steps and cannot
  be resumed): the resumable sampler is sharded by data-parallel rank, so every rank of a group draws and collates
  the same rows (padded to a multiple of N, position_ids in every batch), and `shard` keeps this rank's slice of the
  sequence, with the labels shifted on the whole row first (a shard's last token predicts the next shard's first).
- The loss: each rank's token-loss sum over its slice, divided by the global batch's label tokens
(ds_exp/train/step.py):
  the sum over all ranks is the loss of the global batch, and DeepSpeed's gradient reduction makes it exact.
- Packed rows: the wrapped attention runs per document (`isolate_documents`), so documents never see each other.
- Generation runs without sharding (`paused`): a decode step has one token, nothing to shard.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from peft import PeftModel
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ds_exp.config.batch import data_parallel_size
from ds_exp.config.sp_checks import head_problems
from ds_exp.core import compat
from ds_exp.core.errors import ConfigError

IGNORE_INDEX = -100
# a transformers attention function (ALL_ATTENTION_FUNCTIONS): (module, query, key, value, mask, ...) -> (out, weights)
AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place: `size` ranks train each row together; `rank` is its place in that group."""

    size: int = 1
    rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1

    @classmethod
    def of(cls, rank: int, world_size: int, size: int) -> SequenceParallel:
        size = max(int(size), 1)
        return cls(size=size, rank=rank % size, dp_rank=rank // size, dp_size=data_parallel_size(world_size, size))

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def counts_rows(self) -> bool:
        """Whether this rank counts its group's rows (samples, tokens, label tokens): one rank per group does, so
        sums over all ranks count every row once."""
        return self.rank == 0

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of a collated batch (every rank of the group holds the same one): `shift_labels` (the
        label each position predicts, from the whole row) and every [rows, length] tensor cut along the sequence.
        The attention mask is dropped: DeepSpeed's wrapper takes causality from position_ids, and right padding sits
        behind every real token."""
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
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None)
    problems = head_problems(size, heads, kv, "its config")
    if problems:
        raise ConfigError(problems)


def isolate_documents(core: AttentionFunction) -> AttentionFunction:
    """`core` (a transformers attention function) run per document where a row's position_ids restart: equal to a
    block-diagonal causal mask, without building one. Under Ulysses the position_ids in kwargs are the whole row's
    (DeepSpeed gathers them), and no mask reaches the core function, so plain sdpa would let packed documents attend
    to each other; flash attention reads documents from position_ids only for one row per batch."""

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
    """What `register` changed in transformers' attention table, so generation can step around it and a later run of
    this process can start clean."""

    def __init__(self, key: str, original: AttentionFunction, sharded: AttentionFunction) -> None:
        self.key, self.original, self.sharded = key, original, sharded
        self.paused = False

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return (self.original if self.paused else self.sharded)(*args, **kwargs)


_registered: _Registration | None = None


def register(model_config: PretrainedConfig, attention: str, size: int, micro_batch_size: int) -> ModuleType:
    """Collective (makes the groups): DeepSpeed's Ulysses attention for `attention` (an ALL_ATTENTION_FUNCTIONS key,
    never eager), before the model is built as DeepSpeed asks. Returns the mpu for deepspeed.initialize."""
    global _registered

    check_heads(model_config, size)
    unregister()
    original = ALL_ATTENTION_FUNCTIONS[attention]
    ALL_ATTENTION_FUNCTIONS[attention] = isolate_documents(original)  # the core function DeepSpeed wraps
    holder = _ConfigHolder(model_config)  # the model is not built yet: DeepSpeed reads only `.config`
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


class _ConfigHolder:
    def __init__(self, config: PretrainedConfig) -> None:
        self.config = config


def check_model_attention(model: PreTrainedModel | PeftModel, attention: str) -> None:
    """The built model runs the attention that was wrapped (transformers may have fallen back to another)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    actual = getattr(config, "_attn_implementation", None)
    if actual is not None and actual != attention:
        raise ConfigError(
            f"dist.sequence_parallel_size > 1 wraps {attention} attention, but this model runs {actual}: set "
            f"model.attn_implementation={attention} if the model supports it (sdpa or flash_attention_2)"
        )


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Attention without sharding while it lasts (generation: every rank runs whole sequences)."""
    registration = _registered
    if registration is None:
        yield
        return
    registration.paused = True
    try:
        yield
    finally:
        registration.paused = False


def unregister() -> None:
    """The attention table as it was, and DeepSpeed's group references released: a later run in this process (a
    multirun) registers afresh."""
    global _registered
    if _registered is None:
        return

    ALL_ATTENTION_FUNCTIONS[_registered.key] = _registered.original
    _registered = None
    compat.release_sequence_parallel_groups()
