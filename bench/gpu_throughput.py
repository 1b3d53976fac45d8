"""On CUDA only: tokens/s and model FLOPs utilization (MFU) of a ~1B-parameter model in bf16 at ZeRO 2 and 3,
ds_exp against the bare DeepSpeed loop and Hugging Face's Trainer, on every GPU of the machine (one rank each).

    python -m bench gpu_throughput        # skipped, with the reason, on a machine without CUDA

The model is the tiny Llama of conf/model/tiny.yaml widened to 2048 hidden, 5632 intermediate, 20 layers, 16
heads (about 1.0B parameters with the embedded 512-token vocabulary), random init; the synthetic task is packed
into rows of 1024 tokens so that every micro batch is full. The comparison is bench/step_time.py's (same
model, data, micro batches and DeepSpeed config for all three; ds_exp's FusedAdam, the Trainer's fused
AdamW). MFU = achieved model FLOP/s / the GPU's dense bf16 peak, with 6 N + 12 L h s FLOPs per token
(forward and backward of the N parameters, plus attention scores over sequence length s).
"""

from __future__ import annotations

import sys
from typing import Any

from bench.common import write_result
from bench.step_time import Setup, compare

HIDDEN, INTERMEDIATE, LAYERS, HEADS, SEQ_LEN, MICRO_BATCH = 2048, 5632, 20, 16, 1024, 8
STAGES = (2, 3)
OVERRIDES = (
    f"model.arch.hidden_size={HIDDEN}",
    f"model.arch.intermediate_size={INTERMEDIATE}",
    f"model.arch.num_hidden_layers={LAYERS}",
    f"model.arch.num_attention_heads={HEADS}",
    f"model.arch.num_key_value_heads={HEADS}",
    f"model.arch.max_position_embeddings={SEQ_LEN}",
    "precision=bf16",
    "data.packing=true",
    f"data.max_seq_len={SEQ_LEN}",
    "data.synthetic.num_train=20000",
    f"train.micro_batch_size={MICRO_BATCH}",
)
# Dense bf16 tensor-core peak per GPU (FLOP/s), from the vendors' data sheets (SXM parts).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def parameters(vocab: int = 512) -> int:
    """Parameters of the widened Llama: tied embeddings, q/k/v/o, gate/up/down, two RMSNorms a layer + final."""
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN
    return vocab * HIDDEN + LAYERS * per_layer + HIDDEN


def flops_per_token(n_params: int) -> float:
    return 6 * n_params + 12 * LAYERS * HIDDEN * SEQ_LEN


def peak_flops(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16.items() if key in device_name), None)


def main(quick: bool = False) -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device here (this benchmark needs a GPU; the CPU set does not)")
        return None
    gpus, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    setup = Setup(nproc=gpus, steps=20 if quick else 40, warmup_windows=1, reps=1, overrides=OVERRIDES)
    payload = compare(setup, STAGES[:1] if quick else STAGES, describe={"gpus": gpus, "device": name})
    n_params, peak = parameters(), peak_flops(name)
    per_token = flops_per_token(n_params)
    mfu_rows = []
    for stage, result in payload["stages"].items():
        for method in ("ds_exp", "bare", "hf_trainer"):
            tokens_per_s = result[method].get("tokens_per_s")
            if tokens_per_s is None:
                continue
            achieved = tokens_per_s * per_token / gpus
            result[method]["mfu"] = achieved / peak if peak else None
            mfu_rows.append((stage, method, tokens_per_s, result[method]["mfu"]))
    payload["model"] = {"parameters": n_params, "flops_per_token": per_token, "peak_bf16_flops_per_gpu": peak}
    for stage, method, tokens_per_s, mfu in mfu_rows:
        print(f"ZeRO-{stage} {method}: {tokens_per_s:,.0f} tokens/s, MFU {mfu if mfu is None else f'{mfu:.1%}'}")
    write_result("gpu_throughput_quick" if quick else "gpu_throughput", payload)
    return payload


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
