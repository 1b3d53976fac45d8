"""`load_tokenizer`: the tokenizer of the run, with a pad token and a single-token end of conversation."""

from __future__ import annotations

import logging

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ds_exp.config.model_checks import checkpoint_error
from ds_exp.config.paths import embedded_tokenizer_dir
from ds_exp.config.schema import DataConfig, ModelConfig, plain
from ds_exp.core.errors import DataError, first_line

log = logging.getLogger(__name__)


def tokenizer_source(model: ModelConfig) -> str:
    """model.tokenizer, else model.name_or_path, else the tokenizer shipped in ds_exp/assets."""
    return str(model.tokenizer or model.name_or_path or embedded_tokenizer_dir())


def load_tokenizer(model: ModelConfig, data: DataConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of `model`; `data` says which end-of-conversation token it must hold as one token."""
    source = tokenizer_source(model)
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=bool(model.trust_remote_code))
    except (OSError, ValueError, KeyError) as err:
        key = "model.tokenizer" if model.tokenizer else "model.name_or_path"
        if key == "model.name_or_path" and source == model.name_or_path:
            mapped = checkpoint_error(model, err)  # config.json names the cause better (custom code, model_type)
            if mapped is not None:
                raise mapped from None
        first = first_line(err)
        raise DataError(
            f"{key}={source}: cannot load a tokenizer ({first}); use a local directory with tokenizer files "
            "(nothing is downloaded offline), or null for the embedded one"
        ) from None
    tok.padding_side = "right"  # the collator pads right; generation code may switch it locally
    if tok.pad_token is None:
        if tok.eos_token is not None:
            # safe: padding is masked by position in the collator, never by comparing with pad_token_id
            tok.pad_token = tok.eos_token
        else:
            tok.add_special_tokens({"pad_token": "<|pad|>"})
            log.warning("tokenizer %s has no pad or eos token; added <|pad|> (vocab now %d)", source, len(tok))
    _ensure_end_of_conversation(data, tok, source)
    return tok


def _ensure_end_of_conversation(data: DataConfig, tok: PreTrainedTokenizerBase, source: str) -> None:
    """DeepSpeed-Chat's add_eot_token: a configured end-of-conversation token must be one token."""
    eot, template = data.end_of_conversation_token, plain(data.template)
    if eot is None or template == "chat_template" or (template == "auto" and tok.chat_template):
        return
    if len(tok(eot, add_special_tokens=False)["input_ids"]) == 1:
        return
    tok.add_tokens([eot], special_tokens=True)  # same call in transformers 4 and 5; never split again
    log.warning(
        "data.end_of_conversation_token=%s is not one token of %s: added it as a special token "
        "(vocab now %d; the model's embeddings must be resized to match)",
        eot,
        source,
        len(tok),
    )
