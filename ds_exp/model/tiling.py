"""Long-context compute: tiled MLPs, a tiled loss, activation offload (the tiling half of DeepSpeed's ALST recipe).

Each knob trades speed for activation memory and leaves the math as it was: a run with any of them on has the
losses of the run without (tests/integration/test_tiling.py; fp32, 1e-5 relative).

* `model.tiled_mlp`: every decoder layer's MLP runs over `shards` slices of the sequence, each slice under its own
  (non-reentrant) activation checkpoint, so the MLP's intermediate activations (several tokens x intermediate
  tensors) exist for one slice at a time, in the forward and in the backward, which recomputes each slice. This is
  DeepSpeed's TiledMLP (ALST) computed with torch.utils.checkpoint, for two reasons. (1) ZeRO-3 gathers the MLP's
  weights for every slice, so every rank must run the same number of slices or the gathers hang: ds_exp fixes the
  number from the config (never from the batch) and always cuts exactly that many (`torch.tensor_split`; slices may
  be empty), while DeepSpeed's TiledMLP cuts with `torch.chunk`, which returns fewer pieces than asked for some
  lengths (9 tokens in 4 -> 3), so ranks holding rows of different lengths would disagree even with an agreed
  count. (2) A checkpoint per slice keeps one backward pass: every weight's gradient is accumulated once, so
  ZeRO's gradient hooks need no `ds_grad_is_ready` bookkeeping (a DeepSpeed-internal attribute).
  Position-wise MLPs only (every token computed on its own): the MLP module of each decoder layer.
* `model.tiled_loss`: the final hidden states go through the output embeddings (lm_head) and the cross-entropy in
  chunks of tokens, each chunk checkpointed: one chunk's logits exist at a time, forward and backward. It returns
  the per-rank sum of token losses and the label count, exactly what `ds_exp.train.step.token_loss_sum` computes from
  full logits, so the step's exact reduction over the global batch is unchanged. It runs inside lm_head's own call
  (that call's forward is replaced while a tiled loss is asked for), so under ZeRO-3 lm_head is gathered once per
  forward as usual. DeepSpeed's TiledFusedLogitsLoss does not fit: it accumulates lm_head's gradient during the
  forward with an incoming gradient of 1, and scales only the hidden states' gradient by the real one in backward,
  while ds_exp's step scales the loss by world x micro batches / global label tokens.
* `model.activation_offload`: with gradient checkpointing, what each checkpointed layer keeps for its recompute
  (its input) is saved through `torch.autograd.graph.save_on_cpu` around the decoder's forward: in pinned host
  memory, copied back when the backward recomputes the layer (ALST's checkpoint offload; transformers 5 has the
  same as `activation_checkpointing_enable(offload=True)`, which pins memory unconditionally and so fails on a
  host without CUDA). On a CPU the activations already live in host memory: nothing moves.

Slices and chunks are counted from `data.max_seq_len` (per sequence-parallel rank) and the micro batch sizes, fixed
before training, so every rank runs the same number whatever its batch holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from ds_exp.config.long_context import TilingPlan
from ds_exp.core.errors import ConfigError, RunFailed
from ds_exp.model.head_loss import HeadLoss

IGNORE_INDEX = -100  # labels that never count (torch cross_entropy's ignore_index)
KNOB = "model.tiled_loss=true"


# ------------------------------------------------------------------------------------------------ tiled MLP


def decoder_mlps(model: torch.nn.Module) -> list[torch.Tensor | torch.nn.Module]:
    """The `mlp` module of every decoder layer (transformers' GradientCheckpointingLayer)."""
    return [m.mlp for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and hasattr(m, "mlp")]


def tile_mlps(model: torch.nn.Module, shards: int, model_type: str) -> int:
    """Make every decoder MLP of `model` compute over `shards` sequence slices; returns how many were tiled."""
    mlps = [m for m in decoder_mlps(model) if isinstance(m, torch.nn.Module)]
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


# ------------------------------------------------------------------------------------------------ tiled loss


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


# ------------------------------------------------------------------------------------------ activation offload


def offload_saved_activations(model: Any) -> None:
    """Everything the decoder's forward saves for backward outside the checkpointed layers goes to host memory
    through `torch.autograd.graph.save_on_cpu` (pinned where CUDA is): with gradient checkpointing that is each
    layer's input (checkpoint saves it as an input of its own; the layers' insides are recomputed, never saved)
    and the final norm's. Wrapping the decoder's forward, a public attribute, instead of transformers' checkpoint
    function (set by the private `_set_gradient_checkpointing`) keeps every other activation where it was."""
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


def apply_tiling(model: PreTrainedModel | PeftModel, plan: TilingPlan, model_type: str) -> HeadLoss | None:
    """Tiled MLPs and activation offload on the built model (after LoRA and gradient checkpointing); the tiled
    loss to compute losses with, or None for the model's own logits."""
    if plan.mlp_shards:
        tile_mlps(model, plan.mlp_shards, model_type)
    if plan.offload:
        offload_saved_activations(model)
    if not plan.loss_chunks:
        return None
    head = model.get_output_embeddings()
    if head is None:
        raise ConfigError(
            f"model.tiled_loss=true: the {model_type} model has no output embeddings (lm_head) to compute the loss "
            "through; set model.tiled_loss=false"
        )
    chunks = plan.loss_chunks
    return HeadLoss(head, lambda forward, _, h, y: chunked_loss_sum(forward, h, y, chunks), model_type, KNOB)
