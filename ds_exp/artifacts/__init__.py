"""What a run leaves for people and tools: the Hugging Face export (export), summary.json (summary), and the metric
sinks metrics.jsonl, wandb (tracking), TensorBoard (tensorboard_run) and MLflow (mlflow_run), the run's picture
plots/loss.png (loss_plot), and lm-evaluation-harness scores of exports, the base model beside (harness, harness_base,
harness_report).

Layer 9, heavy. May import: the light layers, ds_exp.runtime, ds_exp.model.
"""
