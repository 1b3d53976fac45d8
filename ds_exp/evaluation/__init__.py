"""Evaluation: lm-evaluation-harness scores of a run's export beside its base model's, through lm-eval's Python API
(pip install -e ".[eval]"), after training or by `python -m ds_exp.evaluate TARGET TASK...` (cli.py, plan.py).

Settings: `eval.harness.*` (HarnessConfig); on when eval.harness.tasks names a task. checks.py and fit.py (light)
refuse before any model loads: unknown or unreachable tasks, rows beyond the model's positions, missing few-shot
examples, disk room. tasks.py: the offline tasks `ds_exp_synthetic` and `ds_exp_passkey`. harness.py (heavy): the
scoring, the base model (its checkpoint, or its init rebuilt from train.seed) and its scores' cache. report.py:
harness.json, the table, the chart. hooks.py: `after_run` scores the final export and its base on rank 0,
`after_export` each step export with every_save; a failure is the evaluation's own status, never the run's.

Written: RUN_DIR/eval/; summary.json's `harness`, `harness_base`, `harness_status`; metrics.jsonl and the trackers'
harness/<task>/<metric>."""
