"""Exports and chat: what a run trained, in Hugging Face format, and a conversation with it.

Owns: the run's exports, the final one (train.export_dir) and with train.export_every one every N steps beside it
(<export_dir>-step<N>; this run's newest train.export_keep_last kept), each the base model's identity (vocabulary,
dtype, tokenizer, generation config) with ds_exp_export.json saying how it was made, from what, and how the run
asked its model; with LoRA every export writes the adapter (<export_dir>_adapter) and the merged model where
train.export_merged puts one. `python -m ds_exp.export CHECKPOINT [DIR]` writes what the run's own export of that
step holds, from any complete checkpoint at any ZeRO stage and world size (--merged, --adapter, --dtype);
`python -m ds_exp.chat DIR` answers as the run's generations did (a conversation on a terminal, a line per prompt
when piped).

Settings: train.export, export_dir, export_merged, export_every, export_keep_last, export_dtype: ExportSettings,
mixed into TrainConfig (the keys stay in `train`); a run's exports also read model, lora.dim and
data.end_of_conversation_token (feature.py's RunExportSettings).

Hooks (ds_exp/train/hooks.py): planned_writes (the exports' room on disk and their targets, before the engine),
on_branch (the exports a resume's abandoned branch takes along), after_step (a step export, then rotation),
after_train (the final export); each export written then calls every feature's after_export.

Modules: settings, feature, checks (what an export or a chat refuses before torch), on_disk (exports on disk, their
rotation, a run's config from its directory), writer (the export itself, from the engine or from a checkpoint),
run (the hooks), cli (both commands: parsed and refused before torch), chat. Light: settings, feature, checks,
on_disk, cli.
"""
