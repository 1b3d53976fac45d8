"""The SFT data pipeline: sources -> phase splits -> blend -> tokenize -> Arrow cache -> collate / sample.

Importing this package is cheap (no torch, datasets or transformers): every entry point imports what it
needs when called, so `--help` and config validation stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ds_exp.data.checks import check_data_config

if TYPE_CHECKING:
    from ds_exp.config.schema import DataConfig, ModelConfig
    from ds_exp.data.pipeline import SFTData
    from ds_exp.data.sampler import ResumableDistributedSampler

__all__ = [
    "ResumableDistributedSampler",
    "SFTData",
    "check_data_config",
    "count_train_examples",
    "load_tokenizer",
    "make_collator",
    "prepare_sft_data",
]


def load_tokenizer(model: ModelConfig, data: DataConfig) -> Any:
    """model.tokenizer, else model.name_or_path, else the embedded tokenizer; always padded, and holding
    data.end_of_conversation_token as one token."""
    from ds_exp.data.tokenizer import load_tokenizer as _load

    return _load(model, data)


def prepare_sft_data(data: DataConfig, tokenizer: Any, *, seed: int) -> SFTData:
    """Tokenized train/eval datasets (cached; safe from every rank at once). See pipeline.prepare_sft_data."""
    from ds_exp.data.pipeline import prepare_sft_data as _prepare

    return _prepare(data, tokenizer, seed=seed)


def count_train_examples(data: DataConfig) -> int:
    """SFT train examples after splits, without tokenizing. See pipeline.count_train_examples."""
    from ds_exp.data.pipeline import count_train_examples as _count

    return _count(data)


def make_collator(tokenizer: Any, pad_to_multiple_of: int | None = None, *, isolate_packed: bool = False) -> Any:
    """callable(list of examples) -> dict of torch tensors input_ids, attention_mask, labels."""
    from ds_exp.data.collate import make_collator as _make

    return _make(tokenizer, pad_to_multiple_of, isolate_packed=isolate_packed)


def __getattr__(name: str) -> Any:
    # classes that need torch / datasets are resolved on first use
    if name == "ResumableDistributedSampler":
        from ds_exp.data.sampler import ResumableDistributedSampler

        return ResumableDistributedSampler
    if name == "SFTData":
        from ds_exp.data.pipeline import SFTData

        return SFTData
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
