"""Model FLOPs and the accelerator's peak, for MFU (PaLM's accounting): 4 N + 2 N_trainable per token; attention 12 L d
sum(n_i^2) over a batch's examples (`mfu`), or 12 L d s per token (`mfu_with_attention`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from peft import PeftModel
from transformers import PretrainedConfig, PreTrainedModel

# Dense (not sparse) peak TFLOP/s per device from the vendors' data sheets: bf16/fp16 tensor cores, and fp32
# without TF32 (torch's default for matmuls). Matched against torch.cuda.get_device_name(); first match wins.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("GB200", {"bf16": 2500.0, "fp16": 2500.0, "fp32": 80.0}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("GH200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),  # SXM ("H100 80GB HBM3")
    ("H800", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "fp32": 35.0}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6}),
    ("RTX 3090", {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4}),
]


def device_name(accelerator: str) -> str | None:
    if accelerator != "cuda":
        return None

    return torch.cuda.get_device_name()


def peak_flops(name: str | None, precision: str, override_tflops: float | None = None) -> float | None:
    """FLOP/s per device: the override, else the table's entry (None when unknown: no MFU)."""
    if override_tflops:
        return float(override_tflops) * 1e12
    if not name:
        return None
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            tflops = peaks.get(precision)
            return tflops * 1e12 if tflops else None
    return None


@dataclass(frozen=True)
class FlopsModel:
    matmul_params: int  # weights that take part in matrix multiplies
    trainable_matmul_params: int  # of those, the ones with weight gradients
    layers: int
    hidden: int

    def per_batch(self, tokens: float, sum_squared_lengths: float) -> float:
        """ds_exp's count: the attention of each example (sum of its squared lengths)."""
        return self.matmul_per_token * tokens + 12 * self.layers * self.hidden * sum_squared_lengths

    def per_batch_row_attention(self, tokens: float, row_length: int) -> float:
        """torchtitan's and llm-foundry's count: every token attends over its whole row (12 L d s per token)."""
        return (self.matmul_per_token + 12 * self.layers * self.hidden * row_length) * tokens

    @property
    def matmul_per_token(self) -> int:
        return 4 * self.matmul_params + 2 * self.trainable_matmul_params


def flops_model(model: PreTrainedModel | PeftModel, config: PretrainedConfig) -> FlopsModel:
    """From the built model (ZeRO-3: partitioned parameters report their full size in ds_numel)."""
    text_config = getattr(config, "text_config", None) or config
    layers = int(getattr(text_config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(text_config, "hidden_size", 0) or 0)
    total = trainable = 0
    for param in model.parameters():
        n = numel(param)
        total += n
        trainable += n if param.requires_grad else 0
    embedding: torch.Tensor = model.get_input_embeddings().weight  # type: ignore[assignment]  # transformers: nn.Module
    tied = bool(getattr(text_config, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    if not tied:  # a lookup, not a multiply
        total -= numel(embedding)
        trainable -= numel(embedding) if embedding.requires_grad else 0
    return FlopsModel(total, trainable, layers, hidden)


def numel(param: torch.Tensor) -> int:
    return int(getattr(param, "ds_numel", 0) or param.numel())  # ZeRO-3 keeps the full size in ds_numel


def sum_squared_lengths(batch: dict[str, torch.Tensor]) -> float:
    """sum(n_i^2) over a host batch's sequences: rows of an attention mask, or packed examples (position_ids)."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return float((mask.sum(dim=1).double() ** 2).sum())
    positions = batch.get("position_ids")
    if positions is None:
        width = batch["input_ids"].size(1)
        return float(batch["input_ids"].size(0) * width * width)

    total = 0.0
    for row in positions:
        starts = [*torch.nonzero(row == 0).flatten().tolist(), row.numel()]
        total += sum((b - a) ** 2 for a, b in itertools.pairwise(starts))
    return float(total)
