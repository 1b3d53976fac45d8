"""Exports and chat: what a run trained, in Hugging Face format, and a conversation with it.

The final export (train.export_dir), one every train.export_every steps (<export_dir>-step<N>, the newest
train.export_keep_last kept), with LoRA the adapter and the merged model; each with ds_exp_export.json saying how it
was made. `python -m ds_exp.export CHECKPOINT [DIR]` writes the same from a checkpoint; `python -m ds_exp.chat DIR`
answers as the run's generations did. Settings: train.export* (ExportSettings, mixed into TrainConfig). Hooks:
planned_writes, on_branch, after_step, after_train; each export then calls every feature's after_export.
Light: settings, feature, checks, on_disk, cli; heavy: writer, run (the hooks), chat."""
