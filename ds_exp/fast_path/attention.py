"""The attention kernel a run uses (model.attn_implementation). `auto` on CUDA in 16 bits: flash_attention_2 where
flash-attn is installed, else `torch_varlen` (registered here), else sdpa; off CUDA, transformers' default.
flash_attention_2/3 run varlen from position ids only for one row, so ds_exp hands them the example boundaries."""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ds_exp.fast_path.checks import TORCH_VARLEN

log = logging.getLogger(__name__)

# attention implementations that take the micro batch's example boundaries (transformers' FlashAttentionKwargs)
TAKES_BOUNDARIES = ("flash_attention_2", "flash_attention_3", TORCH_VARLEN)


def torch_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: each packed example attends causally to itself (varlen kernel); else sdpa."""
    boundaries = kwargs.get("cu_seq_lens_q")
    if boundaries is None or query.size(2) == 1 or (dropout and module.training):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    rows, heads, length, size = query.shape
    q, k, v = (x.transpose(1, 2).reshape(rows * length, x.size(1), size) for x in (query, key, value))
    out = varlen_causal_attention(q, k, v, boundaries, int(kwargs["max_length_q"]), scaling)
    return out.view(rows, length, heads, size), None


AttentionInterface.register(TORCH_VARLEN, torch_varlen_attention)
AttentionMaskInterface.register(TORCH_VARLEN, sdpa_mask)  # the mask of a batch without boundaries (padded rows)


def varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: torch.Tensor, longest: int, scale: float | None
) -> torch.Tensor:
    """Causal attention of each example on its own (`boundaries`: int32 starts, the total last): on CUDA torch's varlen
    kernel (a prototype whose arguments changed in torch 2.13), elsewhere one example at a time through SDPA."""
    if q.device.type != "cuda":
        gqa = k.size(1) != q.size(1)
        pieces = []
        for a, b in itertools.pairwise(boundaries.tolist()):
            one_q, one_k, one_v = (x[a:b].transpose(0, 1) for x in (q, k, v))
            out = F.scaled_dot_product_attention(one_q, one_k, one_v, is_causal=True, scale=scale, enable_gqa=gqa)
            pieces.append(out.transpose(0, 1))
        return torch.cat(pieces)
    from torch.nn.attention.varlen import varlen_attn

    accepts = inspect.signature(varlen_attn).parameters
    options: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in accepts else {"is_causal": True}
    if k.size(1) != q.size(1):
        if "enable_gqa" in accepts:
            options["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.size(1) // k.size(1), dim=1) for x in (k, v))
    if scale is not None and "scale" in accepts:
        options["scale"] = scale
    elif scale is not None:
        q = q * (scale * math.sqrt(q.size(-1)))  # the kernel's own scale is 1 / sqrt(head size)
    result = varlen_attn(q, k, v, boundaries, boundaries, longest, longest, **options)
    return result[0] if isinstance(result, tuple) else result


def attn_implementation(requested: str | None, ds_config: dict[str, Any], sequence_parallel: int = 1) -> str | None:
    """model.attn_implementation with auto decided (None: transformers' default, sdpa)."""
    if requested != "auto":
        return requested
    half = any(ds_config.get(key, {}).get("enabled") is True for key in ("bf16", "fp16"))
    if not (half and torch.cuda.is_available()):
        return None
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if sequence_parallel == 1 and torch_varlen_works():
        return TORCH_VARLEN
    log.info("model.attn_implementation=auto: neither flash-attn nor torch's varlen kernel runs here: sdpa")
    return None


def torch_varlen_works() -> bool:
    """torch's varlen kernel tried once on this GPU; a torch or GPU without it leaves auto with sdpa."""
    try:
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        q, k, v = (torch.randn(8, 2, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        boundaries = torch.tensor([0, 3, 8], device="cuda", dtype=torch.int32)
        varlen_causal_attention(q, k, v, boundaries, 5, None).sum().backward()
        torch.cuda.synchronize()
    except Exception as err:  # ImportError on an older torch, a RuntimeError from the kernel
        log.info("torch's varlen attention does not run here (%s)", " ".join(str(err).split())[:200])
        return False
    return True


def example_boundaries(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A packed host batch's example boundaries as a varlen kernel takes them; {} when not packed."""
    positions = batch.get("position_ids")
    if positions is None or "attention_mask" in batch:
        return {}
    flat = positions.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    starts[:: positions.size(1)] = True  # every row starts an example
    cuts = torch.cat([torch.nonzero(starts).flatten(), torch.tensor([flat.numel()])]).to(torch.int32)
    longest = int((cuts[1:] - cuts[:-1]).max())
    return {"cu_seq_lens_q": cuts, "cu_seq_lens_k": cuts, "max_length_q": longest, "max_length_k": longest}
