"""Evaluation: did the fine-tune help? lm-evaluation-harness scores of a run's export beside its base model's,
through lm-eval's own Python API (pip install -e ".[eval]"), after training or afterwards by command.

Settings: `eval.harness.*` (settings.py's HarnessConfig types the schema's EvalConfig.harness): tasks, every_save,
template, base, limit, num_fewshot, batch_size, device, passkey_lengths. On when eval.harness.tasks names a task. The
feature is handed `Scoring` (checks.py): eval.harness, ds_exp_passkey's lengths, train.export(_every), the model.

* checks.py, fit.py (light): refused before any model loads, one line each: eval.harness against the exports and the
  device, lm-eval missing, a task unknown, rejected by lm-eval or whose data is missing or out of reach, the tasks
  against the model (fit.py: missing fields, prompts beyond its positions, few-shot examples it lacks, disk room),
  an optuna objective `harness.<task>.<metric>` no task reports.
* tasks.py: ds_exp's offline tasks, `ds_exp_synthetic` (multiple choice from the embedded task) and `ds_exp_passkey`.
* harness.py (heavy): the scoring (simple_evaluate on an HFLM of the export, prompts in the run's template), the base
  model (its checkpoint, or its init rebuilt from train.seed) and its scores' cache, the command's work.
* report.py: harness.json, the console table, the chart, the numbers summary.json and the trackers keep.
* hooks.py: `after_run` scores the final export and its base on rank 0 once the engine is released; `after_export`
  each step export with every_save. A failure is the evaluation's own status, never the run's.
* cli.py, plan.py: `python -m ds_exp.evaluate TARGET TASK...`, every refusal before torch.

Written: RUN_DIR/eval/ (harness.json, harness.png, lm-eval's files); summary.json's `harness`, `harness_base`,
`harness_status`; metrics.jsonl and the trackers' harness/<task>/<metric>, which sweep reports and studies read.
"""
