"""Export the trained model in Hugging Face format (safetensors + config + tokenizer).

The full weights are gathered on rank 0 (ZeRO-3: layer by layer, by DeepSpeed), loaded into a CPU copy of
the model, LoRA merged into the base weights by PEFT, and saved into a temporary directory that is renamed
into place only when complete.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def gather_full_state_dict(engine: Any, zero_stage: int) -> dict[str, Any] | None:
    """Collective. The whole state dict on rank 0 (None on the other ranks)."""
    import torch.distributed as dist

    if zero_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # gathers per layer onto rank 0; keeps the dtype
    else:
        state = engine.module.state_dict() if dist.get_rank() == 0 else None
    if dist.get_rank() != 0:
        return None
    return {k: v.detach().to("cpu").clone() for k, v in state.items()}


def export_hf(
    engine: Any,
    *,
    zero_stage: int,
    model_config: Any,
    tokenizer: Any,
    lora: Any | None,
    export_dir: Path,
    save_adapter: bool,
) -> Path | None:
    """Collective; rank 0 writes `export_dir` (and `export_dir`_adapter with `save_adapter`)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    state = gather_full_state_dict(engine, zero_stage)
    if dist.get_rank() == 0:
        assert state is not None
        unset_hf_deepspeed_config()  # the CPU copy below must be a plain, unpartitioned model
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
        if lora is not None:
            from ds_exp.model import wrap_lora

            model = wrap_lora(model, lora)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not _is_tied_copy(model, k)]
        if missing or unexpected:
            raise RuntimeError(f"export: state dict does not fit the model: missing {missing}, unexpected {unexpected}")
        tmp = export_dir.with_name(f".{export_dir.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if lora is not None:
            if save_adapter:
                adapter_tmp = export_dir.with_name(f".{export_dir.name}_adapter.tmp")
                shutil.rmtree(adapter_tmp, ignore_errors=True)
                model.save_pretrained(str(adapter_tmp), safe_serialization=True)
                _replace(adapter_tmp, export_dir.with_name(f"{export_dir.name}_adapter"))
            model = model.merge_and_unload()
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        _replace(tmp, export_dir)
        log.info("exported Hugging Face model to %s", export_dir)
    dist.barrier()
    return export_dir if dist.get_rank() == 0 else None


def _is_tied_copy(model: Any, key: str) -> bool:
    """lm_head.weight is absent from the state dict of a model whose embeddings are tied."""
    return key.endswith("lm_head.weight") and bool(getattr(model.config, "tie_word_embeddings", False))


def _replace(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    src.rename(dst)
