"""Prompt/answer pairs -> unpadded input_ids and labels, through `datasets.map` with the fast tokenizer.

The prompt/answer boundary is found from the character offsets of one joint tokenization (what the model
sees at inference), so it is exact for BPE and SentencePiece tokenizers alike and no token is split in two.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ds_exp.data.sources import Rows

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # labels that never count in the loss (torch cross_entropy's ignore_index)
# Below this many rows a process pool costs more than it saves: the fast tokenizer already uses threads.
PARALLEL_MIN_ROWS = 50_000


def resolve_template(template: str, tokenizer: Any) -> str:
    """dschat or chat_template; auto = chat_template when the tokenizer has one."""
    template = getattr(template, "value", template)
    if template == "auto":
        return "chat_template" if getattr(tokenizer, "chat_template", None) else "dschat"
    if template == "chat_template" and not getattr(tokenizer, "chat_template", None):
        from ds_exp.errors import DataError

        raise DataError(
            "data.template=chat_template: the tokenizer has no chat template; use dschat or auto, "
            "or a tokenizer that ships one"
        )
    return str(template)


def end_of_conversation(eot: str | None, tokenizer: Any) -> str:
    """The text appended after the answer by the dschat template: the configured token, else the eos."""
    return eot if eot is not None else (tokenizer.eos_token or "")


@dataclass
class Encoder:
    """The batched map function. A plain picklable object so `num_proc > 1` can ship it to workers."""

    tokenizer: Any
    template: str  # resolved: dschat | chat_template
    eot: str
    max_seq_len: int
    train_on_prompt: bool

    def texts(self, prompt: str, chosen: str) -> tuple[str, int]:
        """(full text, number of characters that belong to the prompt)."""
        if self.template == "dschat":
            head = f" Human: {prompt} Assistant:"
            return f"{head} {chosen}{self.eot}", len(head)
        user = [{"role": "user", "content": prompt}]
        head = self.tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = self.tokenizer.apply_chat_template([*user, {"role": "assistant", "content": chosen}], tokenize=False)
        if full.startswith(head):
            return full, len(head)
        # templates that rewrite earlier turns (rare): the prompt is the common prefix
        shared = min(len(head), len(full))
        return full, next((i for i in range(shared) if head[i] != full[i]), shared)

    def __call__(self, batch: dict[str, list[str]]) -> dict[str, list[Any]]:
        pairs = [self.texts(p, c) for p, c in zip(batch["prompt"], batch["chosen"], strict=True)]
        texts = [t for t, _ in pairs]
        # chat templates carry their own bos; DeepSpeed-Chat's format relies on the tokenizer adding it
        add_special = self.template == "dschat"
        fast = getattr(self.tokenizer, "is_fast", False)
        # one token past the limit tells truncated examples apart without tokenizing huge texts whole
        enc = self.tokenizer(
            texts,
            add_special_tokens=add_special,
            truncation=True,
            max_length=self.max_seq_len + 1,
            return_offsets_mapping=fast,
            return_attention_mask=False,
        )
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "truncated": [], "keep": []}
        for i, ids in enumerate(enc["input_ids"]):
            prompt_chars = pairs[i][1]
            if fast:
                offsets = enc["offset_mapping"][i]
                # the prompt is the longest prefix of tokens starting inside it (specials at (0, 0) included)
                n_prompt = next((j for j, (s, e) in enumerate(offsets) if s >= prompt_chars and e > s), len(ids))
            else:  # slow tokenizers have no offsets: tokenize the prompt alone (exact for most)
                head = self.tokenizer(texts[i][:prompt_chars], add_special_tokens=add_special)["input_ids"]
                n_prompt = len(head)
            truncated = len(ids) > self.max_seq_len
            ids = list(ids[: self.max_seq_len])
            labels = list(ids)
            if not self.train_on_prompt:
                labels[: min(n_prompt, len(ids))] = [IGNORE_INDEX] * min(n_prompt, len(ids))
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["truncated"].append(truncated)
            out["keep"].append(any(label != IGNORE_INDEX for label in labels))
        return out


def pick_num_proc(num_proc: int | None, num_rows: int) -> int:
    if num_proc is not None:
        return max(1, min(num_proc, -(-num_rows // 1000)))  # no more processes than map batches
    if num_rows < PARALLEL_MIN_ROWS:
        return 1
    return max(1, min(4, os.cpu_count() or 1))


def encode(rows: Rows, encoder: Encoder, *, num_proc: int | None, desc: str) -> tuple[Any, dict[str, int]]:
    """A datasets.Dataset with input_ids/labels (int32 lists) and counts: truncated, dropped."""
    import datasets
    import numpy as np
    import pyarrow.compute as pc

    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "labels": datasets.List(datasets.Value("int32")),
            "truncated": datasets.Value("bool"),
            "keep": datasets.Value("bool"),
        }
    )
    raw = datasets.Dataset.from_dict({"prompt": rows.prompt, "chosen": rows.chosen})
    procs = pick_num_proc(num_proc, len(raw))
    ds = raw.map(
        encoder,
        batched=True,
        batch_size=1000,
        num_proc=procs if procs > 1 else None,
        remove_columns=["prompt", "chosen"],
        features=features,
        load_from_cache_file=False,
        new_fingerprint=f"ds_exp-encode-{desc}",  # skips hashing the tokenizer; our own cache keys the result
        desc=f"Tokenizing {desc}",
    )
    # counted on the Arrow columns (map's output has no indices mapping, so ds.data is its rows): iterating
    # ds["..."] formats one row at a time (seconds per 100k rows)
    truncated = int(pc.sum(ds.data.column("truncated")).as_py() or 0)
    keep = ds.data.column("keep").to_numpy()
    dropped = int(len(keep) - keep.sum())
    if dropped:
        ds = ds.select(np.flatnonzero(keep).tolist())
    ds = ds.remove_columns(["truncated", "keep"])
    return ds, {"truncated": truncated, "dropped": dropped}


def pack(ds: Any, max_seq_len: int) -> Any:
    """Greedily concatenate consecutive examples up to max_seq_len; labels keep each example's masking.

    position_ids restart at 0 for every example, so a trainer that passes them without an attention mask
    gets per-example causal attention from transformers (it builds block-diagonal masks from them).
    """
    import datasets

    packed: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    cur_pos: list[int] = []
    columns = ds.select_columns(["input_ids", "labels"]).to_dict()  # whole columns, not row by row
    for ids, labels in zip(columns["input_ids"], columns["labels"], strict=True):
        if cur_ids and len(cur_ids) + len(ids) > max_seq_len:
            packed["input_ids"].append(cur_ids)
            packed["labels"].append(cur_labels)
            packed["position_ids"].append(cur_pos)
            cur_ids, cur_labels, cur_pos = [], [], []
        cur_ids += ids
        cur_labels += labels
        cur_pos += range(len(ids))
    if cur_ids:
        packed["input_ids"].append(cur_ids)
        packed["labels"].append(cur_labels)
        packed["position_ids"].append(cur_pos)
    features = datasets.Features({k: datasets.List(datasets.Value("int32")) for k in packed})
    return datasets.Dataset.from_dict(packed, features=features)
