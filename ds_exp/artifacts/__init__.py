"""What a run leaves for people and tools: summary.json (summary), and the metric
sinks: metrics.jsonl and the trackers behind one fan-out (tracking), each tracker a module of trackers/ (wandb,
TensorBoard, MLflow) behind one interface (trackers/base.py), the run's picture plots/loss.png (loss_plot), and
lm-evaluation-harness scores of exports, the base model beside (harness, harness_base, harness_report).

Layer 9, heavy. May import: the light layers, ds_exp.runtime, ds_exp.model.
"""
