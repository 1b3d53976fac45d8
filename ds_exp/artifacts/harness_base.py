"""The base model a run started from, as lm-eval scores it, and its scores' cache.

The base is what the run's config builds before training (ds_exp.model.build, the same call the run made):
the pretrained checkpoint, or for a model built from its config (the default run) its initialization, rebuilt from
train.seed. Rebuilt rather than saved at the start: init_weights_by_name draws every module's weights from
(train.seed, its name) alone, so the rebuild is the run's step-0 model at any ZeRO stage and world size
(tests/integration/test_harness.py compares its perplexity with the run's step-0 evaluation), nothing is written
during training, and runs made before scores existed have their base too. It is exported as the run exports
(ds_exp/artifacts/export.py: vocabulary, dtype and tokenizer of the tuned export) into a scratch directory, so the
two are loaded and asked alike; a checkpoint whose vocabulary and dtype the export kept is scored where it is.

The base's scores are cached under data.cache_dir, one entry per (model, TASK, settings), written whole under a
lock: a sweep of 20 jobs over one base model scores it once, and a rerun not at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig

from ds_exp.artifacts.export import DTYPES, TOKENIZER_FILES, export_spec, write_export
from ds_exp.config.schema import Config
from ds_exp.core.files import json_text
from ds_exp.data.cache import file_lock, hash_key, path_fingerprint
from ds_exp.launch.exports import read_metadata
from ds_exp.model.architecture import checkpoint_dtype
from ds_exp.model.build import build_model
from ds_exp.model.tokenizer import load_tokenizer

CACHE = "harness-base"  # under data.cache_dir
SCORES = "scores.json"
WRITTEN_BY = "ds_exp harness: the base model"


def base_identity(cfg: Config, tuned_dir: Path) -> dict[str, Any]:
    """What the base model's scores depend on: how it is built (or the checkpoint's files), the tokenizer and dtype
    the tuned export has."""
    meta = read_metadata(tuned_dir)
    tokenizer = {name: path_fingerprint(tuned_dir / name) for name in TOKENIZER_FILES if (tuned_dir / name).is_file()}
    if cfg.model.name_or_path is None:
        model: dict[str, Any] = {
            "arch": cfg.model.arch,
            "seed": cfg.train.seed,
            "vocab_multiple": cfg.model.vocab_multiple,
            "built_with": [torch.__version__, transformers.__version__],  # their init code draws the weights
        }
    else:
        path = Path(cfg.model.name_or_path).expanduser()
        model = (
            {"checkpoint": str(path.resolve()), "files": path_fingerprint(path)}
            if path.exists()
            else {"hub": cfg.model.name_or_path}
        )
    return {"model": model, "tokenizer": tokenizer, "dtype": meta.get("dtype")}


def _for_rebuild(cfg: Config) -> Config:
    """The run's config for the base alone, in this process: no LoRA (its adapters start as the identity), no
    sequence-parallel groups, no GPU kernels, no long-context tiling (none of them changes a weight)."""
    cfg = dataclasses.replace(cfg)
    cfg.lora = dataclasses.replace(cfg.lora, dim=0, quantize=None)
    cfg.dist = dataclasses.replace(cfg.dist, sequence_parallel_size=1)
    attention = None if cfg.model.attn_implementation == "auto" else cfg.model.attn_implementation
    cfg.model = dataclasses.replace(
        cfg.model,
        liger_kernel=False,
        attn_implementation=attention,
        gradient_checkpointing=False,
        tiled_mlp=False,
        tiled_loss=False,
        activation_offload=False,
    )
    return cfg


def scored_in_place(cfg: Config, tuned_dir: Path) -> Path | None:
    """The base checkpoint itself when the tuned export kept its vocabulary and dtype (nothing to rebuild)."""
    path = cfg.model.name_or_path
    if path is None or not Path(path).expanduser().is_dir():
        return None
    meta = read_metadata(tuned_dir)
    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    rows = int(getattr(config.get_text_config(), "vocab_size", 0) or 0)
    same = meta.get("vocab_size") == rows and meta.get("dtype") == checkpoint_dtype(cfg.model)
    return Path(path).expanduser() if same else None


@contextlib.contextmanager
def base_model_dir(cfg: Config, tuned_dir: Path, scratch: Path) -> Iterator[Path]:
    """A directory lm-eval loads the base model from: the checkpoint itself, or an export of the rebuilt model
    written under `scratch` (removed after)."""
    direct = scored_in_place(cfg, tuned_dir)
    if direct is not None:
        yield direct
        return
    meta = read_metadata(tuned_dir)
    generation = meta.get("generation") or {}
    rebuilt = _for_rebuild(cfg)
    tokenizer = load_tokenizer(rebuilt.model, rebuilt.data)
    built = build_model(rebuilt, tokenizer, {"zero_optimization": {"stage": 0}})
    state = dict(built.model.state_dict())
    spec = export_spec(
        rebuilt,
        built,
        "fp32",
        template=generation.get("template"),
        stop_token_ids=tuple(generation.get("stop_token_ids") or ()),
        origin={"written_by": WRITTEN_BY, "model": cfg.model.name_or_path or f"{cfg.model.name}, train.seed"},
    )
    names = {name: key for key, name in DTYPES.items()}
    spec = dataclasses.replace(spec, dtype=names.get(str(meta.get("dtype")), "fp32"))  # the tuned export's
    # built from a config, every weight comes from the rebuild; a checkpoint's are copied from it exactly
    trained = set(state) if cfg.model.name_or_path is None else set()
    del built
    target = scratch / f".base-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_export(state, trained, spec, tokenizer, target)
        yield target
    finally:
        shutil.rmtree(target, ignore_errors=True)


class BaseCache:
    """The base model's scores under <data.cache_dir>/harness-base/: <model>-<task and settings>/ holds
    scores.json and lm-eval's files for that TASK. An entry is complete once its directory has its name."""

    def __init__(self, cache_dir: Path, identity: dict[str, Any], settings: dict[str, Any]) -> None:
        self.root = cache_dir / CACHE
        self.model_key = hash_key(identity)
        self.settings = settings

    def entry(self, fingerprint: str) -> Path:
        return self.root / f"{self.model_key}-{hash_key([fingerprint, self.settings])}"

    def read(self, fingerprint: str) -> dict[str, Any] | None:
        try:
            found = json.loads((self.entry(fingerprint) / SCORES).read_text())
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One process scores a base model at a time (the jobs of a sweep started together wait, then read)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with file_lock(self.root / f"{self.model_key}.lock"):
            yield

    def scratch(self) -> Path:
        path = self.root / f".{self.model_key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path

    def store(self, fingerprint: str, files: Path, scores: dict[str, Any]) -> None:
        """`files` (lm-eval's, for this TASK) and `scores` become the entry (renamed into place: complete or absent)."""
        (files / SCORES).write_text(json_text(scores, indent=2, sort_keys=True) + "\n")
        target = self.entry(fingerprint)
        if target.exists():
            shutil.rmtree(target)
        files.rename(target)
