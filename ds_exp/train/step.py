"""One optimizer step: forward passes, the exact loss, backward passes, and the votes every rank casts. A step's loss is
the summed token loss over the global batch divided by its label tokens, whatever the split over ranks, micro batches or
sequence-parallel slices (the step undoes DeepSpeed's average). In fp16 at ZeRO 0 it applies the loss scale DeepSpeed
leaves out (Fp16LossScale)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from ds_exp.config.batch import data_parallel_size
from ds_exp.core import compat
from ds_exp.core.errors import RunFailed
from ds_exp.model.head_loss import IGNORE_INDEX
from ds_exp.model.hooks import Batch
from ds_exp.train.collate import SFTCollator, make_collator
from ds_exp.train.flops import FlopsModel, sum_squared_lengths


def next_token_targets(batch: Batch) -> torch.Tensor:
    """The label each position is scored on (labels[t + 1]); a sequence-parallel slice carries them shifted already."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]


def token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor | None = None, *, shift_labels: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over label tokens (fp32), and their count; `shift_labels` are shifted already."""
    # Shift the labels, not the logits: slicing the logits would copy them (batch x length x vocabulary) and
    # scatter their gradient back; the padded last position is ignored like any other masked token.
    if shift_labels is not None:
        targets = shift_labels
    else:
        assert labels is not None, "token_loss_sum needs labels or shift_labels"
        targets = next_token_targets({"labels": labels})
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss, (targets != IGNORE_INDEX).sum()


# (engine, model inputs, next-token targets) -> (summed token loss, label tokens): logits_loss, or the fused or the
# tiled loss (ds_exp.model.head_loss.HeadLoss)
BatchLoss = Callable[[torch.nn.Module, dict[str, Any], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def logits_loss(
    engine: torch.nn.Module, inputs: dict[str, Any], targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed token loss and label tokens from the full logits (the fused and tiled losses: model/head_loss.py)."""
    out = engine(**inputs, use_cache=False)
    return token_loss_sum(out.logits, shift_labels=targets)


def batch_loss(
    loss: BatchLoss | None, engine: torch.nn.Module, batch: Batch, boundaries: dict[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's summed token loss and label tokens; `boundaries`: a packed batch's examples for a varlen attention."""
    return (loss or logits_loss)(engine, {**model_inputs(batch), **(boundaries or {})}, next_token_targets(batch))


def model_inputs(batch: Batch) -> Batch:
    """input_ids with attention_mask, or with position_ids for packed batches (each example attends to itself)."""
    return {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}


def loss_labels(batch: Batch) -> Batch:
    """token_loss_sum's labels for a batch: a sequence-parallel slice carries them shifted already."""
    if "shift_labels" in batch:
        return {"shift_labels": batch["shift_labels"]}
    return {"labels": batch["labels"]}


def input_tokens(batch: Batch) -> float:
    """Counted on the host batch (before it moves to the device), so counting never syncs with the device."""
    mask = batch.get("attention_mask")
    return float(mask.sum()) if mask is not None else float(batch["input_ids"].numel())


def label_tokens(batch: Batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


BatchResult = tuple[torch.Tensor, torch.Tensor | int, list[torch.Tensor]]  # (summed loss, its count, more sums)


class Objective:
    """What a run's steps optimize: here SFT's summed next-token loss over label tokens; a feature supplies another
    (FeatureHooks.objective). A batch's loss is a sum and the count it is averaged over."""

    name = "sft"
    pairs = False  # trains on preference pairs: the data pipeline's chosen_* / rejected_* columns
    sums: tuple[str, ...] = ()  # the names of the more sums a batch reports
    shown: tuple[str, ...] = ("perplexity",)  # what an evaluation's log line and trackers say beside its loss
    generates = True  # eval.prompts are completed at evaluations (a causal LM)
    model_class: Any = AutoModelForCausalLM  # what transformers builds and the export reloads

    def collator(self, tokenizer: PreTrainedTokenizerBase, **options: Any) -> SFTCollator:
        return make_collator(tokenizer, **options)

    def units(self, batch: Batch) -> int:
        """What the step's loss is averaged over, counted on the host batch: label tokens."""
        return label_tokens(batch)

    def loss(
        self, engine: torch.nn.Module, batch: Batch, head: BatchLoss | None, boundaries: dict[str, Any] | None = None
    ) -> BatchResult:
        summed, count = batch_loss(head, engine, batch, boundaries)
        return summed, count, []

    def line(self, sums: list[float], count: float) -> dict[str, float]:
        """A train line's numbers besides its loss, from the window's sums over ranks."""
        return {}

    def evaluation(self, loss_sum: float, count: float, sums: list[float]) -> dict[str, float]:
        """An evaluation's result from its sums over ranks (summary.json's initial_eval / final_eval)."""
        eval_loss = loss_sum / max(count, 1.0)
        return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 700.0)), "eval_tokens": count}


SFT = Objective()


@dataclass(frozen=True)
class Ranks:
    """This rank's place: `size` ranks train each row together (sequence parallelism), `rank` its place among them."""

    size: int = 1
    rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1

    @classmethod
    def of(cls, rank: int, world_size: int, size: int) -> Ranks:
        size = max(int(size), 1)
        return cls(size=size, rank=rank % size, dp_rank=rank // size, dp_size=data_parallel_size(world_size, size))

    @property
    def enabled(self) -> bool:
        """Whether rows are split over ranks (sequence parallelism)."""
        return self.size > 1

    @property
    def counts_rows(self) -> bool:
        """One rank per group counts its rows, so sums over all ranks count every row once."""
        return self.rank == 0


@dataclass(frozen=True)
class StepVotes:
    """What every rank learns at the start of a step from the one all-reduce the step makes anyway."""

    global_label_tokens: float  # this step's, over all ranks and micro batches
    stop: float  # ranks that had caught a stop signal when the step began
    non_finite: float  # ranks whose previous step ended with a non-finite loss
    previous_loss_sum: float = 0.0  # the previous step's summed token losses over all ranks (its loss, for the bar)


@dataclass(frozen=True)
class StepResult:
    """This rank's part of one optimizer step."""

    votes: StepVotes
    # summed token losses (a tensor: read only when needed, reading syncs with the device)
    loss_sum: torch.Tensor | float
    label_tokens: int
    input_tokens: float
    samples: int
    flops: float  # model FLOPs of this rank's batches (ds_exp.train.flops: ds_exp's count)
    applied: bool  # False when the fp16 loss scaler skipped the update (gradient overflow)
    flops_row_attention: float = 0.0  # the same in torchtitan's / llm-foundry's count (6 N + 12 L d s per token)
    sums: list[torch.Tensor | float] = field(default_factory=list)  # the objective's more sums (Objective.sums)


class Fp16LossScale:
    """Multiplies the loss's gradient by the fp16 loss scale where DeepSpeed does not: DeepSpeed 0.19.8
    (deepspeedai/DeepSpeed#8393) at ZeRO stage 0 does not scale the loss in `engine.backward`, yet its fp16 optimizers'
    step() unscales. The first scaled backward's gradient (one sync) says whether DeepSpeed scaled, so a fixed DeepSpeed
    is left alone."""

    def __init__(self, engine: DeepSpeedEngine) -> None:
        self.optimizer = engine.optimizer
        self.unscaled = 1.0 / engine.gradient_accumulation_steps()  # engine.backward divides the loss by it
        self.deepspeed_scales: bool | None = None  # decided at the first backward with a scale other than 1

    @staticmethod
    def needed(engine: DeepSpeedEngine) -> bool:
        return isinstance(getattr(engine, "optimizer", None), (FP16_Optimizer, FP16_UnfusedOptimizer))

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        scale = float(self.optimizer.loss_scale)
        if scale == 1.0:
            return grad
        if self.deepspeed_scales is None:
            self.deepspeed_scales = not math.isclose(float(grad), self.unscaled, rel_tol=1e-3)
        return grad if self.deepspeed_scales else grad * scale


class TrainStep:
    """Runs optimizer steps on a DeepSpeed engine (see the module docstring)."""

    def __init__(
        self,
        engine: DeepSpeedEngine,
        *,
        world_size: int,
        flops: FlopsModel,
        ranks: Ranks = Ranks(),
        shard: Callable[[Batch], Batch] | None = None,
        loss: BatchLoss | None = None,
        inputs: Callable[[Batch], dict[str, Any]] | None = None,
        objective: Objective = SFT,
    ) -> None:
        """`shard`: this rank's part of a batch; `inputs`: model inputs read off each host batch (model/hooks.py)."""
        self.engine = engine
        self.world_size = world_size
        self.flops = flops
        self.ranks, self.shard, self.inputs = ranks, shard, inputs
        self.loss = loss  # None: from the full logits (logits_loss); the fused or the tiled loss
        self.objective = objective
        # undoes DeepSpeed's mean over data-parallel ranks (it sums over a sequence-parallel group), and where it
        # divides by the whole world instead (ZeRO-3 under sequence parallelism: ds_exp/core/compat/) that too
        self.rank_scale = world_size // ranks.size * compat.sequence_parallel_gradient_factor(engine, ranks.size)
        self.fp16_loss_scale = Fp16LossScale(engine) if Fp16LossScale.needed(engine) else None

    def __call__(
        self, batches: list[Batch], *, stop_requested: bool, previous_loss: torch.Tensor | float | None
    ) -> StepResult:
        """One step over this rank's micro batches. Its one collective (global label tokens, stop vote, a non-finite
        previous loss) starts before the first forward and is awaited before the first backward, hiding its latency."""
        engine, device, ranks = self.engine, self.engine.device, self.ranks
        scale = self.rank_scale * len(batches)  # undoes DeepSpeed's mean over ranks and micro batches
        # reading the previous step's loss here costs nothing: that step has finished on every device by now
        previous = float(previous_loss) if previous_loss is not None else 0.0
        # a sequence-parallel group's rows are counted once, by one of its ranks, from the whole rows
        labels = [self.objective.units(b) if ranks.counts_rows else 0 for b in batches]
        reduced = torch.tensor(
            [float(sum(labels)), float(stop_requested), float(not math.isfinite(previous)), previous],
            dtype=torch.float64,
            device=device,
        )
        pending = dist.all_reduce(reduced, async_op=True)
        votes: StepVotes | None = None
        loss_sum: torch.Tensor | float = 0.0
        sums: list[torch.Tensor | float] = [0.0] * len(self.objective.sums)
        tokens = samples = flops = row_flops = 0.0
        for batch in batches:
            if ranks.counts_rows:
                batch_tokens = input_tokens(batch)
                tokens += batch_tokens
                samples += batch["input_ids"].size(0)
                flops += self.flops.per_batch(batch_tokens, sum_squared_lengths(batch))
                row_flops += self.flops.per_batch_row_attention(batch_tokens, batch["input_ids"].size(1))
            if self.shard is not None:
                batch = self.shard(batch)
            examples = self.inputs(batch) if self.inputs is not None else {}  # from the host's position ids
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            examples = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in examples.items()}
            summed, _, more = self.objective.loss(engine, batch, self.loss, examples)
            if votes is None:
                pending.wait()
                votes = StepVotes(*reduced.tolist())
                if votes.global_label_tokens == 0:
                    raise RunFailed(
                        "a training batch holds no label tokens: check data.max_seq_len and data.train_on_prompt"
                    )
            sums = [total + value.detach() for total, value in zip(sums, more, strict=True)]
            loss = summed * (scale / votes.global_label_tokens)
            if self.fp16_loss_scale is not None:
                loss.register_hook(self.fp16_loss_scale)
            engine.backward(loss)
            engine.step()
            loss_sum = loss_sum + summed.detach()
        assert votes is not None
        applied = engine.was_step_applied()
        return StepResult(votes, loss_sum, sum(labels), tokens, int(samples), flops, applied, row_flops, sums)
