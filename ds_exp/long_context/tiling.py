"""Long-context compute on the built model: DeepSpeed's ALST tiling, redone for ZeRO and the exact step: every rank cuts
exactly as many slices (ZeRO-3 gathers per slice), and the tiled loss returns the summed loss and label count the exact
step expects. Activation offload: `torch.autograd.graph.save_on_cpu`, pinned."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from ds_exp.core.errors import ConfigError, RunFailed
from ds_exp.long_context.settings import LongContextSettings
from ds_exp.model.architecture import hidden_size_of, text_config
from ds_exp.model.head_loss import IGNORE_INDEX, HeadLoss
from ds_exp.model.hooks import ModelBuild, ModelHooks
from ds_exp.train.hooks import FeatureHooks

log = logging.getLogger(__name__)
KNOB = "model.tiled_loss=true"


def tile_mlps(model: torch.nn.Module, shards: int, model_type: str) -> int:
    """Every decoder layer's `mlp` computed over `shards` sequence slices; returns how many were tiled."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    mlps = [mlp for m in layers if isinstance(mlp := getattr(m, "mlp", None), torch.nn.Module)]
    if not mlps:
        raise ConfigError(
            f"model.tiled_mlp=true: the {model_type} model has no `mlp` module in its decoder layers to tile; "
            "set model.tiled_mlp=false"
        )
    for mlp in mlps:
        mlp.forward = _TiledForward(mlp.forward, shards, model_type)  # whatever forward it has (Liger's too)
    return len(mlps)


class _TiledForward:
    """An MLP's forward over exactly `shards` slices of the sequence (dim -2), each checkpointed."""

    def __init__(self, forward: Callable[[torch.Tensor], object], shards: int, model_type: str) -> None:
        self.forward, self.shards, self.model_type = forward, shards, model_type

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for piece in torch.tensor_split(x, self.shards, dim=-2):  # exactly `shards` pieces, some maybe empty
            if torch.is_grad_enabled():
                out = checkpoint(self.forward, piece, use_reentrant=False)
            else:
                out = self.forward(piece)
            if not isinstance(out, torch.Tensor):
                raise RunFailed(
                    f"model.tiled_mlp=true: the {self.model_type} MLP returns {type(out).__name__}, not one tensor "
                    "(a mixture of experts?); only position-wise MLPs can be tiled: set model.tiled_mlp=false"
                )
            outputs.append(out)
        return torch.cat(outputs, dim=-2)


def chunked_loss_sum(
    head_forward: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, chunks: int
) -> torch.Tensor:
    """sum over tokens of cross_entropy(head(hidden), targets) in fp32, `chunks` slices of tokens at a time."""

    def piece_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head_forward(h)
        return F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX, reduction="sum")

    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    flat_targets = targets.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    pieces = zip(torch.tensor_split(flat_hidden, chunks), torch.tensor_split(flat_targets, chunks), strict=True)
    for h, y in pieces:
        if torch.is_grad_enabled():
            total = total + checkpoint(piece_loss, h, y, use_reentrant=False)
        else:
            total = total + piece_loss(h, y)
    return total


def offload_saved_activations(model: Any) -> None:
    """What the decoder's forward saves outside the checkpointed layers goes to host memory (`save_on_cpu`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT too
    decoder = base.get_decoder()
    decoder.forward = _Offloaded(decoder.forward)


class _Offloaded:
    """A forward whose saved tensors live in host memory until backward needs them."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # looked up at each call (not imported by name): the offload test counts what goes through it
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return self.forward(*args, **kwargs)


class LongContextHooks(FeatureHooks, ModelHooks):
    settings: LongContextSettings

    def after_wrap(self, model: PreTrainedModel | PeftModel, build: ModelBuild) -> None:
        """Tiled MLPs and activation offload on the built model, and the tiled loss unless the fused loss is on."""
        config, model_type = build.config, str(build.config.model_type)
        plan = self.settings.plan(hidden=hidden_size_of(config) or 1, vocab=int(text_config(config).vocab_size))
        if build.loss is not None and plan.loss_chunks:  # the fused loss (ds_exp/fast_path/) came first
            log.info("model.tiled_loss: the fused loss computes the logits in chunks already; no tiled loss on top")
            plan = replace(plan, loss_chunks=0)
        if plan.mlp_shards:
            tile_mlps(model, plan.mlp_shards, model_type)
        if plan.offload:
            offload_saved_activations(model)
        if plan.loss_chunks:
            head = model.get_output_embeddings()
            if head is None:
                raise ConfigError(
                    f"model.tiled_loss=true: the {model_type} model has no output embeddings (lm_head) to compute the "
                    "loss through; set model.tiled_loss=false"
                )
            build.loss = HeadLoss(
                head, lambda f, _, h, y: chunked_loss_sum(f, h, y, plan.loss_chunks), model_type, KNOB
            )
        if plan.mlp_shards or plan.loss_chunks or plan.offload:
            log.info(
                "long context: MLP tiles %s, loss chunks %s, activation offload %s",
                plan.mlp_shards or "off",
                plan.loss_chunks or "off",
                "on" if plan.offload else "off",
            )
