"""The frozen weights (LoRA's base) a checkpoint leaves out: rebuilt by a resume, conversion or export, their identity
(`base_identity`) recorded in each checkpoint and a different rebuilt base refused (`base_change`)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from ds_exp.config.schema import ModelConfig
from ds_exp.core.errors import ResumeError
from ds_exp.core.waits import announce_while
from ds_exp.resume.store import read_marker
from ds_exp.runtime.process_group import broadcast


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The names of the weights training never changes, every name of a tied one included (its state dict has both)."""
    return {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}


def base_identity(model: torch.nn.Module, *, zero3: bool, source: str) -> dict[str, Any] | None:
    """The frozen weights of `model` as built (None when all train); collective at ZeRO-3. `source`: for messages."""
    frozen = [(name, param) for name, param in model.named_parameters() if not param.requires_grad]
    if not frozen:
        return None
    group = dist.is_available() and dist.is_initialized()
    main = not group or dist.get_rank() == 0
    digest, elements = hashlib.sha256(), 0
    with announce_while(f"the identity of the {len(frozen)} frozen weight tensors (SHA-256: about 2 s per GB)"):
        for name, param in frozen:
            gather = deepspeed.zero.GatheredParameters([param]) if zero3 else contextlib.nullcontext()
            with gather, torch.no_grad():
                if main:
                    value = param.detach().to("cpu").contiguous()
                    digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
                    digest.update(value.view(torch.uint8).numpy().data)  # its bytes (bf16 has no numpy dtype)
                    elements += value.numel()
    found = {"tensors": len(frozen), "elements": elements, "sha256": digest.hexdigest(), "source": source}
    return broadcast(found if main else None) if group else found


def built_base(
    model_cfg: ModelConfig,
    seed: int,
    model: torch.nn.Module,
    *,
    zero3: bool,
    checkpoint: Path | None,
    what: str = "resume",
) -> dict[str, Any] | None:
    """Collective: the frozen weights' identity as built; continuing `checkpoint` with others is refused here."""
    source = model_cfg.name_or_path or f"model.arch, initialised from train.seed={seed}"
    base = base_identity(model, zero3=zero3, source=source)
    if checkpoint is not None:
        problem = base_change(read_marker(checkpoint).get("base"), base, checkpoint, what=what)
        if problem is not None:
            raise ResumeError(problem)
    return base


def base_change(saved: dict[str, Any] | None, now: dict[str, Any] | None, tag_dir: Path, *, what: str) -> str | None:
    """Why `tag_dir` (`saved`: its record) cannot be used with the frozen weights built now; None when it can."""
    if not saved or (now is not None and now.get("sha256") == saved.get("sha256")):
        return None
    then = f"{saved.get('elements', 0):,} weights, SHA-256 {str(saved.get('sha256'))[:16]} (from {saved.get('source')})"
    found = f"{now['elements']:,} weights, SHA-256 {now['sha256'][:16]}" if now else "none"
    return (
        f"{what}: {tag_dir} holds only what trains, and the frozen base weights it continues are not those it was "
        f"trained on: {then} in the checkpoint, {found} built now from {now['source'] if now else 'the config'}; "
        "point model.name_or_path at the model the run started from, as it was (or start a new run from this one's "
        "export)"
    )


@contextlib.contextmanager
def trained_only(module: torch.nn.Module) -> Iterator[None]:
    """The module's state without its frozen weights under every name (DeepSpeed keeps a tied weight's other name)."""
    frozen = frozen_names(module)

    def drop(_: torch.nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        for name in frozen:
            state.pop(prefix + name, None)

    handle = module.register_state_dict_post_hook(drop)
    try:
        yield
    finally:
        handle.remove()


def load_trained(src: Mapping[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """A checkpoint's module state (custom_load_fn): frozen weights may be missing, anything else is a strict load's."""
    result = dst.load_state_dict(dict(src), strict=False)
    frozen = frozen_names(dst)
    missing = [key for key in result.missing_keys if key not in frozen]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(dst).__name__}: missing {missing[:4]} "
            f"({len(missing)} in all), unexpected {list(result.unexpected_keys)[:4]} ({len(result.unexpected_keys)})"
        )
