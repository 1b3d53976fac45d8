"""`python -m ds_exp.evaluate`'s work, in one process: a checkpoint exported first (as `python -m ds_exp.export` does),
then the export scored, with the run's base model beside it for a run directory (ds_exp/artifacts/harness.py, as a
run's eval.harness does), and the table printed."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from ds_exp.artifacts.harness import evaluate, settings_of
from ds_exp.artifacts.harness_report import HARNESS_JSON, table
from ds_exp.config.paths import data_cache_dir
from ds_exp.config.schema import DataConfig, SyntheticDataConfig
from ds_exp.data.harness_tasks import BuiltinSettings
from ds_exp.data.templates import has_chat_template
from ds_exp.exports.checks import run_dir_of
from ds_exp.exports.on_disk import read_metadata
from ds_exp.exports.writer import export_checkpoint
from ds_exp.tools.evaluate.plan import Plan


def run(plan: Plan) -> int:
    hf_logging.disable_progress_bar()
    if plan.checkpoint is not None:
        assert plan.cfg is not None  # a checkpoint's run config rebuilds its model
        print(f"ds_exp: exporting {plan.checkpoint} to {plan.model_dir} first", file=sys.stderr)
        run_dir = run_dir_of(plan.checkpoint)
        export_checkpoint(plan.checkpoint, run_dir, plan.cfg, plan.model_dir, adapter=False, dtype=None)
    device = plan.harness.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = settings_of(plan.harness, plan.cfg.eval if plan.cfg else None, template_of(plan.model_dir), device)
    data = plan.cfg.data if plan.cfg is not None else DataConfig(name="synthetic")
    what = f"{plan.model_dir} and its base model" if plan.base else str(plan.model_dir)
    asked = f"prompts in the {settings.template} template" if settings.applied else "lm-eval's own prompts"
    print(f"ds_exp: scoring {what} on {', '.join(s.given for s in plan.specs)} ({asked}, {device})", file=sys.stderr)
    evaluation = evaluate(
        plan.model_dir,
        plan.specs,
        settings,
        out_dir=plan.out_dir,
        cache_dir=data_cache_dir(data.cache_dir),
        builtin=BuiltinSettings(data.synthetic or SyntheticDataConfig(), tuple(plan.harness.passkey_lengths)),
        base_cfg=plan.cfg if plan.base else None,
        title=str(plan.model_dir),
    )
    print(table(evaluation.record))
    cached = " (the base model's scores from the cache)" if plan.base and not evaluation.base_scored else ""
    print(f"ds_exp: scores in {plan.out_dir / HARNESS_JSON}{cached}, chart harness.png, lm-eval's samples beside")
    return 0


def template_of(model_dir: Path) -> str | None:
    """How the model is asked: the run's template (its export says it), else the tokenizer's chat template, else
    lm-eval's own prompts (a model from elsewhere, trained on none)."""
    recorded = (read_metadata(model_dir).get("generation") or {}).get("template")
    if recorded is not None:
        return str(recorded)
    return "chat_template" if has_chat_template(AutoTokenizer.from_pretrained(str(model_dir))) else None
