"""Evaluation: did the fine-tune help? lm-evaluation-harness scores of a run's export beside its base model's,
through lm-eval's own Python API (pip install -e ".[eval]"), after training or afterwards by command.

Settings: `eval.harness.*` (conf/eval/default.yaml's `harness`; settings.py's HarnessConfig, which types the schema's
EvalConfig.harness, each number's range beside it): tasks, every_save, template, base, limit, num_fewshot,
batch_size, device, passkey_lengths. On when eval.harness.tasks names a task. The feature is handed `Scoring`
(checks.py, built by feature.py): eval.harness, ds_exp_passkey's lengths (data.max_seq_len by default),
train.export, train.export_every, and the model section (what the tasks are checked against).

* `settings.py`, `feature.py` (light): HarnessConfig; FEATURE: its settings, when it is on, its checks, its
  objectives, its hooks.
* `checks.py` (light): refused before any model is loaded, one line each (FEATURE.problems): eval.harness against
  the exports (every_save without train.export_every, tasks without train.export), the device (one this machine
  has), lm-eval missing, an unknown task, a task YAML lm-eval rejects (its data file and row named), its data files
  missing, a hub dataset out of reach, the tasks against the model (fit.py); and an optuna objective
  `harness.<task>.<metric>` no task reports (FEATURE.objective_problems).
* `fit.py` (light): one checker of a task against a model, before any weight loads, for validation, the command's
  plan and the scoring alike: rows without the fields a prompt reads, prompts and choices beyond the model's
  positions (in tokens), few-shot examples the task lacks, a group of no tasks, the room lm-eval's files need; the
  questions each score rests on.
* `tasks.py`: ds_exp's own tasks, offline: `ds_exp_synthetic` (multiple choice drawn from the embedded task) and
  `ds_exp_passkey` (a passkey in filler text at a chosen length), task YAMLs and data generated into the data cache.
* `harness.py` (heavy, imported only where tasks are scored): the scoring (simple_evaluate on an HFLM of the export,
  prompts in the run's template, progress on the console, lm-eval's files redacted as they are written), the base
  model (its checkpoint, or its init rebuilt from train.seed, exported as the run exports) and its scores' cache
  (one entry per model, task and settings; the user's own directory, every entry checked), and the command's work.
* `report.py`: harness.json, the console table, the bar chart of base against tuned, the numbers summary.json and
  the trackers keep, and the directory an evaluation is written into (earlier ones set aside).
* `hooks.py`: HarnessHooks at the recipe's named points (ds_exp/train/hooks.py): `after_run` scores the final export
  and its base on rank 0 once the engine is released; `after_export` scores each step export with every_save (whose
  exports then hold the merged model: `merged_exports`). A failure is the evaluation's own status, never the run's.
* `cli.py`, `plan.py`: `python -m ds_exp.evaluate TARGET TASK...` (ds_exp/evaluate.py): a run directory (base
  against final export), an export or model directory, a checkpoint (exported first); every refusal before torch.

Written: RUN_DIR/eval/harness.json, harness.png and lm-eval's own files (eval/<export>/ for a step export);
summary.json's `harness`, `harness_base`, `harness_status`; metrics.jsonl and the trackers' harness/<task>/<metric>.
The sweep report has a column per `harness.<task>.<metric>` (ds_exp/sweeps/report.py reads summary.json, no code of
this package), and an optuna study may take one as its objective.
"""
