"""train.compile: torch.compile of each decoder layer's forward (one graph for all layers); the rest stays eager. auto
compiles on CUDA at ZeRO 0-2 only: ZeRO-3's gathers inside the forward would break the graph."""

from __future__ import annotations

import torch
from transformers.modeling_layers import GradientCheckpointingLayer


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Each decoder layer's forward replaced with torch.compile of it; returns how many (0: none found)."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend)
    return len(layers)
