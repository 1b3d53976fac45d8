"""model.fused_loss: Liger's fused linear cross-entropy, without the full logits tensor: summed over this rank's label
tokens inside the output layer's call (head_loss.py), on a plain Linear only (not one carrying LoRA). It wins over
model.tiled_loss. On a CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1, tests)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from ds_exp.core.errors import ConfigError
from ds_exp.model.head_loss import IGNORE_INDEX, HeadLoss

log = logging.getLogger(__name__)
KNOB = "model.fused_loss"


def output_linear(model: PreTrainedModel | PeftModel) -> torch.nn.Linear | None:
    """The Linear the fused loss multiplies by (the output layer or PEFT's trained copy); None with LoRA on it."""
    head = model.get_output_embeddings()
    copies = getattr(head, "modules_to_save", None)  # PEFT's ModulesToSaveWrapper
    if copies is not None and getattr(head, "active_adapter", None) in copies:
        head = copies[head.active_adapter]
    return head if type(head) is torch.nn.Linear else None


def fused_loss_sum(
    _forward: Callable[..., torch.Tensor], head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Summed cross-entropy over labelled tokens (fp32) through Liger's kernel; a trained weight's gradient in fp32."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    weight: torch.Tensor = head.weight  # type: ignore[assignment]  # a Linear's
    bias = head.bias if isinstance(head.bias, torch.Tensor) else None
    loss = liger_fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        targets.reshape(-1),
        bias=bias,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        accum_dtype=torch.float32 if weight.requires_grad else None,
    )
    return loss.float()


def apply_fused_loss(model: PreTrainedModel | PeftModel, model_type: str, *, asked: bool) -> HeadLoss | None:
    """The fused loss on the built model, or None where the output layer has no single weight (refused under true)."""
    head = output_linear(model)
    if head is None:
        why = "the output layer carries LoRA adapters (or is not a Linear layer): it has no single weight"
        if asked:
            raise ConfigError(
                f"model.fused_loss=true: {why}; leave lm_head out of lora.target_modules / lora.module_name, or set "
                "model.fused_loss=false"
            )
        log.info("model.fused_loss=auto: off, %s", why)
        return None
    return HeadLoss(head, fused_loss_sum, model_type, KNOB)
