"""The typed settings of what a run asks its model besides the loss (the `eval` group, conf/eval/default.yaml): the
prompts it completes (ds_exp/train/generate.py) and the lm-evaluation-harness scores of its export (eval.harness:
ds_exp/data/harness_checks.py checks them, ds_exp/artifacts/harness.py scores). Part of ds_exp/config/schema.py's
Config. Light."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HarnessConfig:
    tasks: list[str] = field(default_factory=list)  # lm-eval task or group names, task YAML paths, ds_exp_* built-ins
    every_save: bool = False  # also score each export of train.export_every (a curve over steps)
    template: bool = True  # prompts in the run's template (its export's); false = lm-eval's own raw prompts
    base: bool = True  # score the base model too (cached under data.cache_dir: once per model, task and settings)
    limit: float | None = None  # lm-eval's --limit: questions per task (a fraction when < 1); null = all
    num_fewshot: int | None = None  # lm-eval's --num_fewshot; null = each task's own
    batch_size: int = 8  # lm-eval's --batch_size
    device: str = "auto"  # auto (cuda when there is one) | cpu | cuda | cuda:N
    passkey_lengths: list[int] = field(default_factory=list)  # ds_exp_passkey's lengths in tokens; [] = max_seq_len


@dataclass
class EvalConfig:
    prompts: list[str] = field(default_factory=list)  # completed at the first and the last evaluation
    prompts_file: str | None = None  # more prompts: one per line, or JSON lines with a "prompt" field
    max_new_tokens: int = 64
    every_eval: bool = False  # also at every evaluation in between
    temperature: float = 0.0  # 0 = greedy; > 0 samples
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much probability; 1 = off
    top_k: int = 0  # sample among the k likeliest tokens; 0 = off
    seed: int = 1234  # seeds each generation's sampling (training's random state is left as it was)
    harness: HarnessConfig = field(default_factory=HarnessConfig)  # lm-eval scores of the export, the base beside
