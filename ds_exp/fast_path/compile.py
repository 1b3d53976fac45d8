"""train.compile: torch.compile of each decoder layer (regional compilation), the layers' hooks left outside.

Every decoder layer of a model is the same code with other weights, and torch.compile treats a module's parameters
as inputs (Dynamo inlines nn.Modules, torch >= 2.5): one compiled graph serves all of them, so compile time is one
layer's, whatever the depth (a whole-model compile traces every layer and the loss around them). Each layer's
`forward` is replaced by its compiled self; the module's call, with the hooks DeepSpeed and PEFT register on it and
transformers' activation checkpoint around it, stays eager. The loss (ds_exp/model/head_loss.py: Liger's fused kernel
or chunks), the embedding and the final norm stay eager too. Compile time is reported on its own (summary.json's
compile_s: torch.compile's own timers) instead of disappearing into the first step.

Decided by ds_exp/fast_path/settings.py: auto compiles on CUDA at ZeRO stages 0-2. At ZeRO-3 DeepSpeed gathers each
submodule's parameters in hooks inside the layer's forward; each is a graph break, so auto leaves ZeRO-3 eager.
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
