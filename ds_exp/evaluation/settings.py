"""eval.harness's settings (conf/eval/default.yaml's `harness`), typing the schema's EvalConfig.harness. Light."""

from __future__ import annotations

from dataclasses import dataclass, field

from ds_exp.config.fields import MAX_TOKENS, Range, above, at_least, setting


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

    def lengths(self, max_seq_len: int) -> tuple[int, ...]:
        """ds_exp_passkey's prompt lengths: passkey_lengths, else the length the run trained for."""
        return tuple(int(n) for n in self.passkey_lengths) or (int(max_seq_len),)
