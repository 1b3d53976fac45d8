"""A loss computed inside the output layer's call, so the logits never exist at once, while ZeRO-3 holds the weight
whole (huggingface/trl#3368); it returns the summed fp32 token loss and label count, as token_loss_sum does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from deepspeed import DeepSpeedEngine

from ds_exp.core.errors import RunFailed

IGNORE_INDEX = -100  # labels that never count (torch cross_entropy's ignore_index)

# (the output layer's own forward, the output layer, final hidden states, next-token targets) -> summed token loss
HeadCompute = Callable[[Callable[..., torch.Tensor], torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class HeadLoss:
    """Per-rank (summed token loss, label tokens) computed by `compute` inside `head`'s call."""

    def __init__(self, head: torch.nn.Module, compute: HeadCompute, model_type: str, knob: str) -> None:
        self.head, self.compute, self.model_type, self.knob = head, compute, model_type, knob
        self._labels: torch.Tensor | None = None
        self._result: torch.Tensor | None = None
        self._checked = False
        self._own_forward = head.forward
        head.forward = self._forward

    def _forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._labels is None:  # generation, or anything else that wants logits
            return self._own_forward(hidden, *args, **kwargs)
        labels, self._labels = self._labels, None
        self._result = self.compute(self._own_forward, self.head, hidden, labels)
        return self._result

    def __call__(
        self, engine: DeepSpeedEngine | torch.nn.Module, inputs: dict[str, Any], targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`targets`: the next-token labels, shifted already (ds_exp.train.step.next_token_targets)."""
        self._labels, self._result = targets, None
        try:
            out = engine(**inputs, use_cache=False)
        finally:
            self._labels = None
        result, self._result = self._result, None
        # what the model returns where its logits would be must be that loss as is (ZeRO-3 hands back a new
        # tensor object carrying its backward hook: compared by value, once, since reading it syncs the device)
        if result is None or out.logits.shape != result.shape or (not self._checked and not bool(out.logits == result)):
            off = self.knob.split("=")[0] + "=false"
            raise RunFailed(
                f"{self.knob}: the {self.model_type} model changes its logits after the output embeddings (or never "
                f"calls them), so a loss computed inside them would not be its loss; set {off}"
            )
        self._checked = True
        return out.logits, (targets != IGNORE_INDEX).sum()
