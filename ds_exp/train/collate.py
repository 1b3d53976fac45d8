"""Per-batch right padding: input_ids, attention_mask, labels (-100 on every pad), as torch tensors."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100


class SFTCollator:
    """Pads to the longest sequence (rounded up to pad_to_multiple_of), finding pads by position, not pad_token_id, so a
    pad that is the eos still trains on the real eos. With isolate_packed=True packed batches get position_ids instead
    of an attention_mask; position_ids=True puts them on every batch (sequence parallelism)."""

    rows_per_example = 1  # rows of a batch one example makes (a preference pair makes two)

    def __init__(
        self,
        pad_token_id: int,
        pad_to_multiple_of: int | None = None,
        isolate_packed: bool = False,
        position_ids: bool = False,
    ):
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.isolate_packed = isolate_packed
        self.position_ids = position_ids

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        lengths = [len(f["input_ids"]) for f in features]
        width = max(lengths, default=0)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(features)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        packed = all("position_ids" in f for f in features) and batch > 0
        # pads continue counting, so they form no new segment and stay behind the causal mask
        wanted = packed or self.position_ids
        position_ids = torch.arange(width, dtype=torch.long).repeat(batch, 1) if wanted else None
        for i, (f, n) in enumerate(zip(features, lengths, strict=True)):
            input_ids[i, :n] = torch.as_tensor(f["input_ids"], dtype=torch.long)
            labels[i, :n] = torch.as_tensor(f.get("labels", f["input_ids"]), dtype=torch.long)
            attention_mask[i, :n] = 1
            if position_ids is not None and "position_ids" in f:
                pos = torch.as_tensor(f["position_ids"], dtype=torch.long)
                position_ids[i, :n] = pos
                if n:
                    position_ids[i, n:] = torch.arange(1, width - n + 1) + pos[-1]
        out = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if packed and self.isolate_packed:
            del out["attention_mask"]
        if position_ids is not None and ((packed and self.isolate_packed) or self.position_ids):
            out["position_ids"] = position_ids
        return out


def make_collator(
    tokenizer: PreTrainedTokenizerBase,
    pad_to_multiple_of: int | None = None,
    *,
    isolate_packed: bool = False,
    position_ids: bool = False,
) -> SFTCollator:
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0  # any id: pads are masked
    return SFTCollator(int(pad), pad_to_multiple_of, isolate_packed, position_ids)
