"""Evaluation: exact perplexity over the whole eval set (exp(summed token loss / label tokens) over ranks, whatever the
batch size or world), and generations of eval.prompts."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset
from deepspeed import DeepSpeedEngine
from transformers import PreTrainedTokenizerBase

from ds_exp.artifacts.tracking import Trackers
from ds_exp.runtime.process_group import all_reduce_sum
from ds_exp.train.collate import SFTCollator
from ds_exp.train.generate import GREEDY, Sampling, generate, write_generations
from ds_exp.train.step import IGNORE_INDEX, SFT, Batch, BatchLoss, Objective, Ranks

log = logging.getLogger(__name__)


def evaluate(
    engine: DeepSpeedEngine,
    eval_set: Dataset,
    collator: SFTCollator,
    *,
    micro_batch: int,
    rank: int,
    world: int,
    ranks: Ranks = Ranks(),  # noqa: B008 (frozen)
    shard: Callable[[Batch], Batch] | None = None,
    loss: BatchLoss | None = None,
    objective: Objective = SFT,
) -> dict[str, float]:
    """Collective: ranks with fewer examples run masked batches, so ZeRO-3's forwards stay in step."""
    if ranks.enabled:
        rank, world = ranks.dp_rank, ranks.dp_size
    mine = list(range(rank, len(eval_set), world))
    batches = math.ceil(math.ceil(len(eval_set) / world) / micro_batch)
    loss_sum = tokens = 0.0
    sums = [0.0] * len(objective.sums)
    engine.eval()
    with torch.no_grad():
        for i in range(batches):
            chunk = mine[i * micro_batch : (i + 1) * micro_batch]
            rows = chunk or [0]
            if ranks.enabled:
                rows = rows + [rows[0]] * (micro_batch - len(rows))
            batch = collator([eval_set[j] for j in rows])
            batch["labels"][len(chunk) * collator.rows_per_example :] = IGNORE_INDEX  # filler rows
            if shard is not None:
                batch = shard(batch)
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            summed, count, more = objective.loss(engine, batch, loss)
            loss_sum += float(summed)
            tokens += float(count)  # a slice's: summed over the group, the rows' own
            sums = [total + float(value) for total, value in zip(sums, more, strict=True)]
    engine.train()
    loss_sum, tokens, *sums = all_reduce_sum([loss_sum, tokens, *sums], engine.device)
    return objective.evaluation(loss_sum, tokens, sums)


class Generations:
    """eval.prompts completed in the run's template (ds_exp/train/generate.py), written by rank 0."""

    def __init__(
        self,
        prompts: list[str],
        *,
        tokenizer: PreTrainedTokenizerBase,
        template: str,
        max_new_tokens: int,
        stop_ids: list[int],
        path: Path,
        sampling: Sampling = GREEDY,
    ) -> None:
        self.prompts, self.tokenizer, self.template = prompts, tokenizer, template
        self.max_new_tokens, self.stop_ids, self.path, self.sampling = max_new_tokens, stop_ids, path, sampling
        self.last_step = -1  # the step of the last generations

    def __call__(self, engine: DeepSpeedEngine, step: int, wandb: Trackers) -> None:
        self.last_step = step
        if not self.prompts:
            return
        # at ZeRO-3 every new token is a collective forward of every rank: tens of seconds, said beforehand
        if engine.global_rank == 0 or engine.zero_optimization_stage() == 3:
            log.info("generating %d prompts (up to %d new tokens each) ...", len(self.prompts), self.max_new_tokens)
        completions = generate(
            engine,
            self.tokenizer,
            self.prompts,
            template=self.template,
            max_new_tokens=self.max_new_tokens,
            stop_ids=self.stop_ids,
            sampling=self.sampling,
        )
        if completions is None:
            return
        rows = write_generations(self.path, step, self.prompts, completions)
        wandb.table("eval/generations", rows, step=step)
        for row in rows:
            log.info("step %d: %r -> %r", step, row["prompt"], row["completion"])
