"""DPO's reference without LoRA: the starting model's log-probabilities of every pair's answers, computed once before
the first step (and before a resume loads), cached beside the tokenized data under a key of the starting model and
precision. Each rank computes every pair in the same batches (a ZeRO-3 forward is collective); no second model copy is
held."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import datasets
import numpy as np
import torch
import torch.distributed as dist

from ds_exp.data.cache import hash_key, path_fingerprint
from ds_exp.data.formats import expand
from ds_exp.preference.checks import PreferenceSettings
from ds_exp.preference.objectives import PairCollator, sequence_logps
from ds_exp.train.workload import Workload

log = logging.getLogger(__name__)


def reference_file(work: Workload, settings: PreferenceSettings, model_path: str | None) -> Path:
    local = expand(model_path) if model_path else None
    files = path_fingerprint(local) if local is not None and local.exists() else None
    key = hash_key({"model": settings.model_key, "files": files, "vocab": len(work.tokenizer)})
    return Path(work.data.stats["cache_path"]) / f"reference-{key}.npz"


def precompute_reference(
    work: Workload, settings: PreferenceSettings, *, model_path: str | None, micro: int, is_main: bool
) -> None:
    """Add ref_chosen / ref_rejected to the train and eval pairs (see the module docstring)."""
    path = reference_file(work, settings, model_path)
    data = work.data
    if path.is_file():
        saved = np.load(path)
        log.info("DPO reference: the starting model's log-probabilities, read from %s", path)
    else:
        log.info("DPO reference: computing the starting model's log-probabilities of %d pairs ...", len(data.train))
        saved = {split: _logps(work, getattr(data, split), micro) for split in ("train", "eval")}
        if is_main:
            tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
            np.savez(tmp, **saved)
            os.replace(tmp, path)  # whole or not at all
        dist.barrier()
    data.train = _with_reference(data.train, saved["train"])
    data.eval = _with_reference(data.eval, saved["eval"])


def _logps(work: Workload, pairs: datasets.Dataset, micro: int) -> np.ndarray:
    """(pairs, 2): chosen and rejected log-probabilities under the engine's weights as they are."""
    engine, collator = work.engine, work.collator
    assert isinstance(collator, PairCollator)
    out = np.zeros((len(pairs), 2), dtype=np.float64)
    engine.eval()
    with torch.no_grad():
        for start in range(0, len(pairs), micro):
            rows = range(start, min(start + micro, len(pairs)))
            columns = pairs[rows.start : rows.stop]  # one read of the Arrow table, not one per row
            batch = collator([dict(zip(columns, row, strict=True)) for row in zip(*columns.values(), strict=True)])
            inputs = {k: batch[k].to(engine.device) for k in ("input_ids", "attention_mask")}
            logps, _ = sequence_logps(engine(**inputs, use_cache=False).logits, batch["labels"].to(engine.device))
            out[rows.start : rows.stop] = logps.view(-1, 2).double().cpu().numpy()
    engine.train()
    if not np.isfinite(out).all():
        raise RuntimeError("the starting model's log-probabilities are not finite")
    return out


def _with_reference(pairs: datasets.Dataset, logps: np.ndarray) -> datasets.Dataset:
    if math.prod(logps.shape) == 0:
        return pairs
    return pairs.add_column("ref_chosen", logps[:, 0].tolist()).add_column("ref_rejected", logps[:, 1].tolist())
