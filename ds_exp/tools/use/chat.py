"""`python -m ds_exp.chat`'s work: an exported model answers as it did during its run.

The prompt is rendered with the template the run trained with (the export's ds_exp_export.json records it, with the
tokens where its generations stopped), else the tokenizer's chat template, else DeepSpeed-Chat's text; generation
is the run's own call (ds_exp/train/generate.py's options, greedy unless --temperature > 0), so a greedy answer to
an eval.prompts prompt is the one the run wrote to generations.jsonl at that step. On a terminal it is a
conversation (each answer streamed; /reset forgets it, /exit or Ctrl-D ends it); otherwise every line of standard
input is one prompt on its own, answered in order.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, TextStreamer
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from ds_exp.core.files import json_text
from ds_exp.data.templates import has_chat_template, render_conversation
from ds_exp.launch.exports import read_metadata
from ds_exp.train.generate import Sampling

DTYPES = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Chat:
    def __init__(self, model_dir: Path, args: argparse.Namespace) -> None:
        hf_logging.disable_progress_bar()
        device = torch.device(
            args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
        # transformers 5 types PreTrainedModel.to through a wrapper whose first parameter is the model itself
        self.model = model.to(device).eval()  # type: ignore[arg-type]
        generation = read_metadata(model_dir).get("generation") or {}
        self.template = choose_template(args.template, generation.get("template"), self.tokenizer)
        self.stop_ids = list(generation.get("stop_token_ids") or []) or self._default_stops()
        self.sampling = Sampling(args.temperature, args.top_p, args.top_k, None)
        self.max_new_tokens = int(args.max_new_tokens)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0] if self.stop_ids else None

    def _default_stops(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        return [int(i) for i in (eos if isinstance(eos, list) else [eos])] if eos is not None else []

    def answer(self, turns: list[tuple[str, str]], streamer: BaseStreamer | None = None) -> str:
        text, add_special = render_conversation(turns, self.template, self.tokenizer)
        ids = self.tokenizer(text, add_special_tokens=add_special, return_tensors="pt")["input_ids"]
        ids = ids.to(self.model.device)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=self.max_new_tokens,
                **self.sampling.generate_kwargs(),
                eos_token_id=self.stop_ids or None,
                pad_token_id=self.pad_id,
                use_cache=True,
                streamer=streamer,
            )
        return str(self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def choose_template(asked: str, recorded: str | None, tokenizer: PreTrainedTokenizerBase) -> str:
    """--template, or (auto) the run's, else the tokenizer's chat template, else dschat."""
    if asked != "auto":
        return asked
    if recorded in ("raw", "dschat") or (recorded == "chat_template" and has_chat_template(tokenizer)):
        return recorded
    return "chat_template" if has_chat_template(tokenizer) else "dschat"


def chat(model_dir: Path, args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    if args.seed is not None:
        torch.manual_seed(args.seed)  # once: the answers that follow draw in order, as a run's generations do
    bot = Chat(model_dir, args)
    if stdin.isatty():
        return conversation(bot, model_dir, stdin, stdout)
    for line in stdin:
        prompt = line.rstrip("\n")
        if not prompt.strip():
            continue
        completion = bot.answer([("user", prompt)])
        print(json_text({"prompt": prompt, "completion": completion}) if args.jsonl else completion, file=stdout)
        stdout.flush()
    return 0


def conversation(bot: Chat, model_dir: Path, stdin: TextIO, stdout: TextIO) -> int:
    mode = "greedy" if bot.sampling.greedy else f"temperature {bot.sampling.temperature}"
    print(
        f"ds_exp chat: {model_dir} ({bot.template} template, {mode}); /reset forgets the conversation, /exit or "
        "Ctrl-D ends it",
        file=sys.stderr,
    )
    turns: list[tuple[str, str]] = []
    streamer = TextStreamer(bot.tokenizer, skip_prompt=True, skip_special_tokens=True)
    while True:
        try:
            prompt = input("you> ")
        except EOFError:
            print(file=stdout)
            return 0
        if prompt.strip() in ("/exit", "/quit"):
            return 0
        if prompt.strip() == "/reset":
            turns = []
            continue
        if not prompt.strip():
            continue
        turns.append(("user", prompt))
        print("model> ", end="", file=stdout, flush=True)
        turns.append(("assistant", bot.answer(turns, streamer)))
