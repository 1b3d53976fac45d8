"""What preference tuning refuses before anything heavy runs: one line each, naming the key (or the file and row) and
the fix. Light: no torch, no deepspeed; the rows are read with ds_exp.data's own readers."""

from __future__ import annotations

from dataclasses import dataclass

from ds_exp.config.features import CheckFacts
from ds_exp.config.schema import DataConfig, plain
from ds_exp.data.formats import resolve_format
from ds_exp.data.sources import located_rows
from ds_exp.preference.settings import ObjectiveConfig


@dataclass(frozen=True)
class PreferenceSettings:
    """What preference tuning reads of a run: its objective and the keys of other sections it depends on."""

    objective: ObjectiveConfig
    data: DataConfig
    lora_dim: int = 0
    lora_modules_to_save: tuple[str, ...] = ()
    sequence_parallel_size: int = 1
    fused_loss: object = "auto"
    tiled_loss: bool = False
    model_key: str = ""  # the starting model as configured (its section, the seed, the precision)
    model_path: str | None = None  # model.name_or_path: its files are part of the reference's key
    harness_tasks: tuple[str, ...] = ()  # eval.harness.tasks

    @property
    def name(self) -> str:
        return str(getattr(self.objective.name, "value", self.objective.name))

    @property
    def reference(self) -> str:
        """Where DPO's reference log-probabilities come from (auto decided)."""
        chosen = str(getattr(self.objective.reference, "value", self.objective.reference))
        if chosen == "auto":
            return "adapters_off" if self.lora_dim > 0 else "precomputed"
        return chosen


PAIRS_FIX = "give prompt/chosen/rejected rows (DeepSpeed-Chat's layout) or train with objective=sft"


def preference_problems(run: PreferenceSettings, facts: CheckFacts) -> list[str]:
    objective = run.objective
    name = str(plain(objective.name))
    if name == "sft":
        return []
    problems = []
    for key, value, why in (
        ("data.packing", run.data.packing, "a pair's two answers are scored as whole rows"),
        ("data.train_on_prompt", run.data.train_on_prompt, "the loss reads the answers' tokens only"),
        ("model.tiled_loss", run.tiled_loss, "the loss needs each answer's log-probabilities, not a token sum"),
        ("model.fused_loss", run.fused_loss is True, "the loss needs each answer's log-probabilities"),
    ):
        if value:
            problems.append(f"{key}=true: objective={name} cannot use it ({why}); set {key}=false")
    if run.sequence_parallel_size > 1:
        problems.append(
            f"dist.sequence_parallel_size={run.sequence_parallel_size}: objective={name} scores whole rows on each "
            "rank; set dist.sequence_parallel_size=1"
        )
    reference = str(plain(objective.reference))
    if name == "dpo" and reference == "adapters_off" and run.lora_dim == 0:
        problems.append(
            "objective.reference=adapters_off needs LoRA adapters to turn off (lora.dim=0); set lora.dim (e.g. 16) or "
            "objective.reference=precomputed"
        )
    if name == "reward" and run.lora_dim > 0 and "score" not in run.lora_modules_to_save:
        problems.append(
            "objective=reward with LoRA: the reward head (score) must train whole beside the adapters; add it: "
            "lora.modules_to_save=[score]"
        )
    if name == "reward" and run.harness_tasks:
        problems.append(
            f"eval.harness.tasks=[{','.join(run.harness_tasks)}]: objective=reward trains a reward model, which writes "
            "no answers for lm-eval to score (its held-out preference accuracy is final_eval.reward_accuracy); set "
            "eval.harness.tasks=[]"
        )
    return problems + pair_problems(run.data, name)


def pair_problems(data: DataConfig, name: str) -> list[str]:
    """The first row of each source without a rejected answer, or with two equal answers (hub sources: when read)."""
    problems = []
    for i, src in enumerate([*data.sources, *data.sft_only_sources]):
        key = f"data.sources[{i}]" if i < len(data.sources) else f"data.sft_only_sources[{i - len(data.sources)}]"
        try:
            if resolve_format(src.path, src.format) == "hub":
                continue
        except ValueError:
            continue  # said by the data checks
        problems += _source_pair_problems(src, key, name)
    return problems


def _source_pair_problems(src: object, key: str, name: str) -> list[str]:
    field = getattr(src, "rejected_field", None) or "rejected"
    seen = with_rejected = 0
    for rows, where in located_rows(src, key):  # type: ignore[arg-type]  # a DataSource
        for j, (roles, contents, rejected) in enumerate(zip(rows.roles, rows.contents, rows.rejected, strict=True)):
            seen += 1
            if rejected is None or not rejected.strip():
                continue
            with_rejected += 1
            if rejected == contents[-1] and roles[-1] == "assistant":
                return [f"{key}: {where[j]}: chosen and rejected are the same answer; fix or remove the row"]
        for j, rejected in enumerate(rows.rejected):
            if with_rejected and (rejected is None or not rejected.strip()):
                return [
                    f"{key}: {where[j]}: no rejected answer ({field!r}); objective={name} trains on pairs: add one "
                    "or remove the row"
                ]
    if seen and not with_rejected:
        return [f"objective={name}: {key} has no rejected answers ({field!r}): it is SFT data; {PAIRS_FIX}"]
    return []
