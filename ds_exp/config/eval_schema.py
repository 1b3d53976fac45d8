"""The typed settings of what a run asks its model besides the loss (the `eval` group, conf/eval/default.yaml): the
prompts it completes (ds_exp/train/generate.py) and the lm-evaluation-harness scores of its export (eval.harness:
ds_exp/data/harness_checks.py checks them, ds_exp/artifacts/harness.py scores). Part of ds_exp/config/schema.py's
Config. Light."""

from __future__ import annotations

from dataclasses import dataclass, field

from ds_exp.config.fields import (
    MAX_TOKENS,
    SEED,
    Range,
    above,
    at_least,
    setting,
)


@dataclass
class HarnessConfig:
    tasks: list[str] = field(default_factory=list)  # lm-eval task or group names, task YAML paths, ds_exp_* built-ins
    every_save: bool = False  # also score each export of train.export_every (a curve over steps)
    template: bool = True  # prompts in the run's template (its export's); false = lm-eval's own raw prompts
    base: bool = True  # score the base model too (cached under data.cache_dir: once per model, task and settings)
    limit: float | None = setting(
        None, range=above(0, " (questions per task; a fraction when < 1), or null for all")
    )  # lm-eval's --limit: questions per task (a fraction when < 1); null = all
    num_fewshot: int | None = setting(
        None, range=at_least(0, ", or null for each task's own")
    )  # lm-eval's --num_fewshot; null = each task's own
    batch_size: int = setting(8, range=at_least(1))  # lm-eval's --batch_size
    device: str = "auto"  # auto (cuda when there is one) | cpu | cuda | cuda:N
    passkey_lengths: list[int] = setting(
        factory=list, range=Range(64, MAX_TOKENS, fix=" tokens")
    )  # ds_exp_passkey's lengths in tokens; [] = max_seq_len


@dataclass
class EvalConfig:
    prompts: list[str] = field(default_factory=list)  # completed at the first and the last evaluation
    prompts_file: str | None = None  # more prompts: one per line, or JSON lines with a "prompt" field
    max_new_tokens: int = setting(64, range=Range(1, MAX_TOKENS))
    every_eval: bool = False  # also at every evaluation in between
    temperature: float = setting(0.0, range=at_least(0, " (0 = greedy, e.g. 0.7 to sample)"))  # 0 = greedy; > 0 samples
    top_p: float = setting(
        1.0, range=Range(0, 1, low_open=True, fix=" (1 = off)")
    )  # nucleus sampling: the smallest set of tokens holding this much probability; 1 = off
    top_k: int = setting(0, range=at_least(0, " (0 = off)"))  # sample among the k likeliest tokens; 0 = off
    seed: int = setting(
        1234, range=SEED
    )  # seeds each generation's sampling (training's random state is left as it was)
    harness: HarnessConfig = field(default_factory=HarnessConfig)  # lm-eval scores of the export, the base beside
