"""train.compile: torch.compile of each decoder layer (regional compilation). The layers are one code with other
weights (Dynamo treats parameters as inputs): one graph serves all, so compile time is one layer's. Each layer's
`forward` is replaced; its call, with DeepSpeed's and PEFT's hooks and the activation checkpoint around it, stays
eager, as do the loss, the embedding and the final norm. summary.json's compile_s reports the compile time apart.
auto compiles on CUDA at ZeRO 0-2 (settings.py): ZeRO-3's gathers inside the forward would break the graph.
"""

from __future__ import annotations

import torch
from transformers.modeling_layers import GradientCheckpointingLayer


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Replace the forward of each decoder layer (transformers' GradientCheckpointingLayer: the repeated blocks of a
    causal LM) with torch.compile of it; returns how many (0: none found)."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend)
    return len(layers)
