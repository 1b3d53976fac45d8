"""`python -m ds_exp.chat`: an export answers as it did in its run, in the template its ds_exp_export.json records,
through the run's generate call; a conversation on a terminal, else one answer per input line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, TextStreamer
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from ds_exp.core.errors import ConfigError, first_line
from ds_exp.core.files import json_text
from ds_exp.data.templates import has_chat_template, render_conversation
from ds_exp.exports.on_disk import read_metadata
from ds_exp.exports.writer import not_finite
from ds_exp.train.generate import Sampling


class Chat:
    def __init__(
        self, model_dir: Path, args: argparse.Namespace, context: int | None = None, notes: TextIO | None = None
    ) -> None:
        """`context`: the positions a prompt and its answer share (checks.context_of); `notes`: where a cut is said."""
        hf_logging.disable_progress_bar()
        device = pick_device(args.device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        generation = read_metadata(model_dir).get("generation") or {}
        self.template = choose_template(args.template, generation.get("template"), self.tokenizer)
        if self.template == "chat_template" and not has_chat_template(self.tokenizer):
            raise ConfigError(
                f"--template chat_template: the tokenizer in {model_dir} has no chat template; use --template auto "
                "(the run's own), dschat or raw"
            )
        self.render([("user", "Hello")])  # a template that cannot render a first turn is said now, not per prompt
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
        bad = not_finite(model.state_dict())
        if bad:
            raise ConfigError(
                f"{model_dir}: {bad}: that model diverged and answers nothing but noise; chat with an earlier export, "
                "or export an earlier checkpoint (python -m ds_exp.export CHECKPOINT)"
            )
        # transformers 5 types PreTrainedModel.to through a wrapper whose first parameter is the model itself
        self.model = model.to(device).eval()  # type: ignore[arg-type]
        self.context, self.notes = context, notes or sys.stderr
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        default_stops = [int(i) for i in (eos if isinstance(eos, list) else [eos])] if eos is not None else []
        self.stop_ids = list(generation.get("stop_token_ids") or []) or default_stops
        self.sampling = Sampling(args.temperature, args.top_p, args.top_k, None)
        self.max_new_tokens = int(args.max_new_tokens)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0] if self.stop_ids else None
        self.hinted = False  # the empty-answer hint is said once

    def render(self, turns: list[tuple[str, str]]) -> tuple[str, bool]:
        """The conversation as the model is asked it; a chat template that raises is one line naming the fix."""
        try:
            return render_conversation(turns, self.template, self.tokenizer)
        except Exception as err:  # jinja's TemplateError, or whatever a template's own raise_exception says
            raise ConfigError(
                f"the tokenizer's chat template failed on this conversation ({type(err).__name__}: {first_line(err)}); "
                "use --template dschat or raw, or fix the template in tokenizer_config.json"
            ) from None

    def answer(self, turns: list[tuple[str, str]], streamer: BaseStreamer | None = None) -> str:
        text, add_special = self.render(turns)
        ids = self.tokenizer(text, add_special_tokens=add_special, return_tensors="pt")["input_ids"]
        room = self.context - self.max_new_tokens if self.context is not None else None
        if room is not None and ids.shape[1] > room:  # past its positions a model fails (or crawls): cut the oldest
            print(
                f"ds_exp chat: the prompt is {ids.shape[1]} tokens; the model's {self.context} positions less "
                f"--max-new-tokens={self.max_new_tokens} leave {room}: its first {ids.shape[1] - room} tokens were "
                "dropped",
                file=self.notes,
            )
            ids = ids[:, -room:]
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
        completion = str(self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        if not completion.strip() and not self.hinted:
            self.hinted = True
            print(f"ds_exp chat: the answer is empty: {empty_answer_hint(self.template)}", file=self.notes)
        return completion


def empty_answer_hint(template: str) -> str:
    """Why an answer may be empty, and what to try, for a prompt asked in `template`."""
    if template == "raw":
        return (
            "the prompt went to the model as typed (template raw), and a model trained on rows that carry their own "
            "markup answers nothing to text without it; try --template dschat, or type the markup (' Human: ... "
            "Assistant:')"
        )
    others = ", ".join(t for t in ("dschat", "chat_template", "raw") if t != template)
    return (
        f"the model ended it at once (its stop token came first) in the {template} template; try another "
        f"--template ({others}), or sampling (--temperature 0.7)"
    )


def choose_template(asked: str, recorded: str | None, tokenizer: PreTrainedTokenizerBase) -> str:
    """--template, or (auto) the run's, else the tokenizer's chat template, else dschat."""
    if asked != "auto":
        return asked
    if recorded in ("raw", "dschat") or (recorded == "chat_template" and has_chat_template(tokenizer)):
        return recorded
    return "chat_template" if has_chat_template(tokenizer) else "dschat"


def pick_device(asked: str) -> torch.device:
    """--device as torch names it (auto: cuda when there is one); refused when this machine has no such device."""
    if asked == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(asked)
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu
    count = int(backend.device_count()) if backend is not None and hasattr(backend, "device_count") else 0
    if device.type == "mps":
        count = int(torch.backends.mps.is_available())
    if (device.index or 0) >= count:
        has = f"{count} {device.type} device{'' if count == 1 else 's'}" if count else f"no {device.type} device"
        raise ConfigError(f"--device={asked}: this machine has {has}; give --device cpu, or auto (cuda if any)")
    return device


def prompts(stdin: TextIO, notes: TextIO) -> Iterator[str | None]:
    """The lines of a piped standard input; None for a line that is not UTF-8 text (said on `notes`)."""
    reconfigure = getattr(stdin, "reconfigure", None)
    if reconfigure is not None:  # undecodable bytes arrive as surrogates, told apart below, instead of an error
        reconfigure(encoding="utf-8", errors="surrogateescape")
    for number, line in enumerate(stdin, 1):
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as err:
            byte = line[err.start].encode("utf-8", "surrogateescape")[0]
            print(
                f"ds_exp chat: line {number} of standard input is not UTF-8 text (byte 0x{byte:02x} at character "
                f"{err.start + 1}): not answered; give UTF-8 text (iconv -t UTF-8 converts a file)",
                file=notes,
            )
            yield None
            continue
        yield line.rstrip("\n")


def chat(
    model_dir: Path,
    args: argparse.Namespace,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    *,
    context: int | None = None,
    notes: TextIO | None = None,
) -> int:
    """Exit status 0; 1 when a line of a piped standard input was not answered (not UTF-8 text)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if args.seed is not None:
        torch.manual_seed(args.seed)  # once: the answers that follow draw in order, as a run's generations do
    bot = Chat(model_dir, args, context, notes)
    if stdin.isatty():
        return conversation(bot, model_dir, stdin, stdout)
    skipped = 0
    for prompt in prompts(stdin, bot.notes):
        if prompt is None:
            skipped += 1
            continue
        if not prompt.strip():
            continue
        completion = bot.answer([("user", prompt)])
        print(json_text({"prompt": prompt, "completion": completion}) if args.jsonl else completion, file=stdout)
        stdout.flush()
    return 1 if skipped else 0


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
        except UnicodeDecodeError as err:  # a terminal in another encoding: say it, and go on
            print(f"ds_exp chat: that line is not UTF-8 text ({err.reason}): type it again", file=sys.stderr)
            continue
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
