"""What a run leaves for people and tools: summary.json (summary), and the metric
sinks: metrics.jsonl and the trackers behind one fan-out (tracking), each tracker a module of trackers/ (wandb,
TensorBoard, MLflow) behind one interface (trackers/base.py), and the run's picture plots/loss.png (loss_plot).

Layer 9, heavy. May import: the light layers, ds_exp.runtime, ds_exp.model.
"""
