"""Did the fine-tune help? `python -m ds_exp.evaluate TARGET TASK [TASK ...]`: lm-evaluation-harness scores of a
run's final export beside its base model's (TARGET a run directory), or of one model (an export, any Hugging Face
model directory, or a checkpoint, exported first as `python -m ds_exp.export` does).

cli.py parses and refuses without torch (the tasks checked by ds_exp/launch/harness_checks.py, the target by
ds_exp/exports/); run.py does the work through ds_exp/artifacts/harness.py, as a run's eval.harness does.
"""
