"""Completions of `eval.prompts` in the run's template, greedy unless eval.temperature > 0 (sampled in a forked random
state: a resume stays exact). At ZeRO-3 all ranks generate together (synced_gpus); else rank 0 alone."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from ds_exp.config.model_checks import position_limit
from ds_exp.config.schema import EvalConfig
from ds_exp.core.errors import ConfigError
from ds_exp.core.files import append_json_line
from ds_exp.data.templates import render_prompt


@dataclass(frozen=True)
class Sampling:
    """Greedy when temperature is 0 (the default), else sampled; `python -m ds_exp.chat`'s options too."""

    temperature: float = 0.0
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # seeds each call's sampling (None: the process's random state)

    @classmethod
    def of(cls, eval_cfg: EvalConfig) -> Sampling:
        return cls(float(eval_cfg.temperature), float(eval_cfg.top_p), int(eval_cfg.top_k), int(eval_cfg.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generate_kwargs(self) -> dict[str, Any]:
        """Every option explicit, so a model's generation_config.json never changes what was asked."""
        if self.greedy:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


GREEDY = Sampling()


@contextlib.contextmanager
def seeded(sampling: Sampling, device: torch.device | str) -> Iterator[None]:
    """Sampling seeded by `sampling.seed` in a forked random state: what follows draws as if nothing happened."""
    if sampling.greedy or sampling.seed is None:
        yield
        return
    device = torch.device(device)
    on_gpu = device.type not in ("cpu", "meta")
    devices = [device.index or 0] if on_gpu else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if on_gpu else "cuda"):
        torch.manual_seed(sampling.seed)
        yield


def load_prompts(eval_cfg: EvalConfig) -> list[str]:
    """eval.prompts, then eval.prompts_file's lines (plain text, or JSON lines with a "prompt" field)."""
    return [prompt for _, prompt in labelled_prompts(eval_cfg)]


def labelled_prompts(eval_cfg: EvalConfig) -> list[tuple[str, str]]:
    """(where it comes from, as messages name it; the prompt)."""
    prompts = [(f"eval.prompts[{i}]", str(p)) for i, p in enumerate(eval_cfg.prompts or [])]
    if eval_cfg.prompts_file:
        path = Path(eval_cfg.prompts_file).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"eval.prompts_file={eval_cfg.prompts_file}: file not found; give a text file with one prompt per line"
            )
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"eval.prompts_file={path}:{number}"
            if line.lstrip().startswith("{"):
                try:
                    prompts.append((where, str(json.loads(line)["prompt"])))
                except (ValueError, KeyError):
                    raise ConfigError(
                        f'eval.prompts_file={path}:{number}: a JSON line needs a "prompt" field, or write the prompt '
                        "as plain text"
                    ) from None
            else:
                prompts.append((where, line.strip()))
    return prompts


def check_generation_room(
    eval_cfg: EvalConfig, model_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, template: str
) -> None:
    """Every rendered prompt plus eval.max_new_tokens fits a learned position table (OPT, GPT-2), before training."""
    found = position_limit(model_config.to_dict())
    if found is None or found[2] != "learned":
        return
    key, limit, _ = found
    wanted = int(eval_cfg.max_new_tokens)
    for where, prompt in labelled_prompts(eval_cfg):
        text, add_special = render_prompt(prompt, template, tokenizer)
        length = len(tokenizer(text, add_special_tokens=add_special)["input_ids"])
        if length + wanted <= limit:
            continue
        model = (
            f"the model's {limit} positions ({model_config.model_type}, {key}={limit}: a learned table of "
            "absolute positions, generating past it fails)"
        )
        fix = (
            f"set eval.max_new_tokens={limit - length} or lower, or shorten the prompt"
            if length < limit
            else "shorten the prompt: it fills them alone"
        )
        raise ConfigError(
            f"{where} is {length} tokens with the {template} template; with eval.max_new_tokens={wanted} that is "
            f"{length + wanted} tokens, beyond {model}: {fix}"
        )


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, end_of_conversation: str | None) -> list[int]:
    """Where a completion ends: the eos, and the end-of-conversation token when it is one token."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if end_of_conversation:
        eot = tokenizer(end_of_conversation, add_special_tokens=False)["input_ids"]
        if len(eot) == 1 and eot[0] not in ids:
            ids.append(eot[0])
    return ids


def generate(
    engine: DeepSpeedEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    template: str,
    max_new_tokens: int,
    stop_ids: list[int],
    sampling: Sampling = GREEDY,
) -> list[str] | None:
    """Collective at ZeRO-3, rank 0 only otherwise (every rank seeds alike). The completions on rank 0, else None."""
    zero3 = engine.zero_optimization_stage() == 3
    rank = dist.get_rank()
    if rank != 0 and not zero3:
        return None
    model = engine.module
    completions: list[str] = []
    engine.eval()
    with torch.no_grad(), seeded(sampling, engine.device):  # sequence parallelism's model generates unsharded
        for prompt in prompts:
            text, add_special = render_prompt(prompt, template, tokenizer)
            ids = tokenizer(text, add_special_tokens=add_special, return_tensors="pt")["input_ids"].to(engine.device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                **sampling.generate_kwargs(),
                eos_token_id=stop_ids,
                pad_token_id=tokenizer.pad_token_id,
                use_cache=True,
                synced_gpus=zero3 and dist.get_world_size() > 1,
            )
            # one sequence decodes to a str (transformers hints str | list[str], the batch's too)
            completions.append(
                tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)  # type: ignore[arg-type]
            )
    engine.train()
    return completions if rank == 0 else None


def write_generations(path: Path, step: int, prompts: list[str], completions: list[str]) -> list[dict[str, Any]]:
    records = [{"step": step, "prompt": p, "completion": c} for p, c in zip(prompts, completions, strict=True)]
    with path.open("a", encoding="utf-8") as fh:
        for record in records:
            append_json_line(fh, record, ensure_ascii=False)
    return records
