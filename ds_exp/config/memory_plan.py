"""Byte accounting, in one place: per-rank memory of model states, what a checkpoint and an export take on disk,
and the peak measured.

Per-rank memory of model states (parameters, gradients, optimizer states) under ZeRO, from the ZeRO
paper's accounting: with mixed precision, 2 bytes of parameters + 2 of gradients + 12 of fp32 master weights
and Adam moments per parameter. In fp32 training: 4 + 4 + 8 (Adam moments) at stage 0, where the torch
optimizer updates the model's own weights, and + 4 more at stages 1-3, where DeepSpeed keeps an fp32 master
partition even in fp32 (measured in bench/memory.py). Stage 1 partitions the optimizer states, stage 2 also
the gradients, stage 3 also the parameters; offload moves optimizer states (and ZeRO-3 parameters) to host
memory. Activations are estimated apart (`estimate_activations`, roughly); communication buckets and buffers
are not included.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MemoryEstimate:
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    device_bytes: int  # on the accelerator, per rank
    host_bytes: int  # offloaded to CPU memory (or NVMe), per rank

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def estimate_model_states(
    total_params: int,
    trainable_params: int,
    *,
    stage: int,
    world_size: int,
    precision: str,
    offload_optimizer: str = "none",
    offload_param: str = "none",
) -> MemoryEstimate:
    weight_bytes = 4 if precision == "fp32" else 2
    # Adam m, v, plus the fp32 master weights wherever a ZeRO optimizer or mixed precision keeps them
    optimizer_per_param = 8 if precision == "fp32" and stage == 0 else 12
    params = total_params * weight_bytes
    grads = trainable_params * weight_bytes
    optimizer = trainable_params * optimizer_per_param
    if stage >= 1:
        optimizer = -(-optimizer // world_size)
    if stage >= 2:
        grads = -(-grads // world_size)
    if stage >= 3:
        params = -(-params // world_size)
    device = host = 0
    for size, offloaded in ((params, offload_param != "none"), (optimizer, offload_optimizer != "none")):
        if offloaded:
            host += size
        else:
            device += size
    device += grads
    return MemoryEstimate(params, grads, optimizer, device, host)


def estimate_activations(
    *,
    micro_batch: int,
    seq_len: int,
    hidden: int,
    intermediate: int,
    layers: int,
    vocab: int,
    precision: str,
    checkpointing: bool,
) -> int:
    """Rough per-rank activation bytes of one micro batch (an approximation, not measured): per decoder layer the
    tensors a pre-norm block keeps for backward (norm inputs, q/k/v, attention and o_proj outputs: ~10 x hidden;
    the MLP's gate, up, activation and product: ~4 x intermediate; attention scores not kept, as with SDPA /
    FlashAttention), and the logits (training dtype, the fp32 copy the loss takes, its gradient). With activation
    checkpointing a layer keeps only its input, and one layer's full activations exist during its recompute."""
    weight_bytes = 4 if precision == "fp32" else 2
    tokens = micro_batch * seq_len
    full_layer = tokens * (10 * hidden + 4 * intermediate) * weight_bytes
    kept = tokens * hidden * weight_bytes * layers + full_layer if checkpointing else full_layer * layers
    logits = tokens * vocab * (weight_bytes + 8)
    return kept + logits


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def checkpoint_bytes(parameters: int, trainable: int, precision: str) -> int:
    """About what one DeepSpeed checkpoint takes: the weights in the training dtype, plus the fp32 master
    weights and the two Adam moments of every trainable parameter (12 bytes each)."""
    weight = 4 if precision == "fp32" else 2
    return parameters * weight + trainable * 12


def export_bytes(parameters: int, precision: str) -> int:
    return parameters * (4 if precision == "fp32" else 2)
