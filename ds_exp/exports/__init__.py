"""Exports and chat: what a run trained, in Hugging Face format, and a conversation with it.

Owns the run's exports: the final one (train.export_dir) and with train.export_every one every N steps beside it
(<export_dir>-step<N>, this run's newest train.export_keep_last kept), each with the base model's identity and
ds_exp_export.json saying how it was made; with LoRA the adapter (<export_dir>_adapter) and the merged model where
train.export_merged puts one. `python -m ds_exp.export CHECKPOINT [DIR]` writes the same from any complete
checkpoint; `python -m ds_exp.chat DIR` answers as the run's generations did.

Settings: train.export* (ExportSettings, mixed into TrainConfig); a run's exports also read model, lora and
data.end_of_conversation_token (feature.py's RunExportSettings). Hooks: planned_writes (room and targets, before the
engine), on_branch (a resume's abandoned exports), after_step (a step export, then rotation), after_train (the final
export); each export then calls every feature's after_export.

Modules: light: settings, feature, checks (refusals before torch), on_disk (exports on disk, rotation, a run's
config), cli (both commands); heavy: writer (the export, from the engine or a checkpoint), run (the hooks), chat.
"""
