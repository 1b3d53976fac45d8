"""The evaluation's entry (ds_exp/config/features.py): on when eval.harness.tasks names a task. Light."""

from __future__ import annotations

from ds_exp.config.features import Feature
from ds_exp.evaluation.checks import Scoring, objective_problems, problems

FEATURE = Feature(
    name="evaluation",
    summary="lm-evaluation-harness scores of the run's export beside its base model's (eval.harness)",
    settings=lambda cfg: Scoring(
        cfg.eval.harness,
        cfg.eval.harness.lengths(cfg.data.max_seq_len),
        cfg.train.export,
        cfg.train.export_every,
        cfg.model,
    ),
    active=lambda scoring: bool(scoring.harness.tasks),
    problems=problems,
    objective_problems=lambda scoring, objective, key: objective_problems(
        objective, list(scoring.harness.tasks), scoring.lengths, key
    ),
    hooks="ds_exp.evaluation.hooks:HarnessHooks",
)
