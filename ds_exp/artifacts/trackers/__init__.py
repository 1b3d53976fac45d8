"""The trackers behind base.Tracker: wandb, tensorboard, mlflow, each imported only when a run turns it on
(ds_exp.config.trackers.TRACKERS names it)."""
