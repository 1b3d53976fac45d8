"""The trackers, a module each behind one interface (base.Tracker): wandb, TensorBoard (tensorboard) and MLflow
(mlflow). Each module is imported only when a run turns its tracker on: ds_exp.config.trackers.TRACKERS names it
by dotted path, with its package and the pip extra that installs it. The fan-out the training loop sees is
ds_exp.artifacts.tracking.Trackers."""
