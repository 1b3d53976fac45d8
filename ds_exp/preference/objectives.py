"""The objectives of preference tuning (ds_exp.train.step.Objective): DPO and its variants against a reference, and a
reward model's pairwise loss, on batches of pairs from `PairCollator` (rows chosen_0, rejected_0, ... with SFT's labels,
and precomputed reference log-probabilities where there are some). DPO (Rafailov et al. 2023), as TRL's DPOTrainer
computes it: with each answer's log-probability summed over its tokens, h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l)
- log ref(y_l)); sigmoid: -(1 - e) log s(beta h) - e log s(-beta h) (e: label smoothing); ipo: (h' - 1 / (2 beta))^2
with each log-ratio divided by its answer's tokens; hinge: relu(1 - beta h). rewards: beta times each log-ratio;
accuracy: the share of pairs whose chosen reward is the higher. A step's loss is the mean over the global batch's pairs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForSequenceClassification

from ds_exp.preference.checks import PreferenceSettings
from ds_exp.train.collate import SFTCollator
from ds_exp.train.step import IGNORE_INDEX, Batch, BatchLoss, BatchResult, Objective, next_token_targets

REFERENCE = "reference"  # a batch's precomputed reference log-probabilities, one per row


class PairCollator(SFTCollator):
    """Each pair as two rows (chosen, then rejected), padded as SFT pads; `reference` where the pairs carry one."""

    rows_per_example = 2

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [
            {"input_ids": f[f"{side}_input_ids"], "labels": f[f"{side}_labels"]}
            for f in features
            for side in ("chosen", "rejected")
        ]
        batch = super().__call__(rows)
        if features and "ref_chosen" in features[0]:
            batch[REFERENCE] = torch.tensor([f[f"ref_{side}"] for f in features for side in ("chosen", "rejected")])
        return batch


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its label tokens (fp32), and how many there are."""
    targets = next_token_targets({"labels": labels})
    mask = targets != IGNORE_INDEX
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logps * mask).sum(-1), mask.sum(-1)


@contextlib.contextmanager
def adapters_off(engine: torch.nn.Module) -> Iterator[None]:
    """The starting model as DPO's reference: the same weights with the LoRA adapters disabled (no second copy)."""
    model = getattr(engine, "module", engine)
    with model.disable_adapter() if isinstance(model, PeftModel) else contextlib.nullcontext():
        yield


class PairObjective(Objective):
    """What DPO and the reward model share: pairs, their count, and the metrics of two scores per pair."""

    pairs = True
    sums = ("rewards_chosen", "rewards_rejected", "correct")
    shown = ("reward_accuracy", "reward_margin")

    def collator(self, tokenizer: Any, **options: Any) -> SFTCollator:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
        return PairCollator(int(pad), options.get("pad_to_multiple_of"))

    def units(self, batch: Batch) -> int:
        return int(self.valid(batch["labels"]).sum())

    @staticmethod
    def valid(labels: torch.Tensor) -> torch.Tensor:
        """The pairs that count: both answers hold label tokens (an evaluation's filler rows hold none)."""
        has = (labels[:, 1:] != IGNORE_INDEX).any(-1)
        return has[0::2] & has[1::2]

    def pair_result(
        self, losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, valid: torch.Tensor
    ) -> BatchResult:
        """The summed loss of the pairs that count, their number, and their rewards' and right rankings' sums."""
        v = valid.to(losses.dtype)
        with torch.no_grad():
            sums = [(chosen * v).sum(), (rejected * v).sum(), ((chosen > rejected).to(v.dtype) * v).sum()]
        return (losses * v).sum(), valid.sum(), sums

    def line(self, sums: list[float], count: float) -> dict[str, float]:
        n = max(count, 1.0)
        chosen, rejected, correct = sums
        return {
            "rewards_chosen": chosen / n,
            "rewards_rejected": rejected / n,
            "reward_margin": (chosen - rejected) / n,
            "reward_accuracy": correct / n,
        }

    def evaluation(self, loss_sum: float, count: float, sums: list[float]) -> dict[str, float]:
        return {"eval_loss": loss_sum / max(count, 1.0), **self.line(sums, count), "eval_pairs": count}


class DPO(PairObjective):
    name = "dpo"

    def __init__(self, settings: PreferenceSettings) -> None:
        objective = settings.objective
        self.beta, self.smoothing = float(objective.beta), float(objective.label_smoothing)
        self.loss_type = str(getattr(objective.loss_type, "value", objective.loss_type))

    def loss(
        self, engine: torch.nn.Module, batch: Batch, head: BatchLoss | None, boundaries: dict[str, Any] | None = None
    ) -> BatchResult:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
        logps, tokens = sequence_logps(engine(**inputs).logits, batch["labels"])
        if REFERENCE in batch:
            reference = batch[REFERENCE].to(logps.dtype)
        else:
            with torch.no_grad(), adapters_off(engine):
                reference, _ = sequence_logps(engine(**inputs).logits, batch["labels"])
        ratios = logps - reference
        chosen, rejected = ratios[0::2], ratios[1::2]
        h = chosen - rejected
        if self.loss_type == "ipo":  # TRL's: each log-ratio per answer token
            per_token = chosen / tokens[0::2].clamp(min=1) - rejected / tokens[1::2].clamp(min=1)
            losses = (per_token - 1 / (2 * self.beta)) ** 2
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - self.beta * h)
        else:
            losses = -(1 - self.smoothing) * F.logsigmoid(self.beta * h) - self.smoothing * F.logsigmoid(-self.beta * h)
        return self.pair_result(
            losses, self.beta * chosen.detach(), self.beta * rejected.detach(), self.valid(batch["labels"])
        )


class Reward(PairObjective):
    """DeepSpeed-Chat step 2's reward model: a scalar per answer's last token, loss -log s(r_chosen - r_rejected)."""

    name = "reward"
    generates = False
    model_class = AutoModelForSequenceClassification

    def loss(
        self, engine: torch.nn.Module, batch: Batch, head: BatchLoss | None, boundaries: dict[str, Any] | None = None
    ) -> BatchResult:
        scores = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()[:, 0]
        chosen, rejected = scores[0::2], scores[1::2]
        losses = -F.logsigmoid(chosen - rejected)
        return self.pair_result(losses, chosen.detach(), rejected.detach(), self.valid(batch["labels"]))
