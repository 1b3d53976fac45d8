"""The cached SmolLM2 fixture is an ordinary Hugging Face checkpoint that still knows things."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_smollm2_checkpoint_reloads_and_answers(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)

    assert model.dtype == torch.bfloat16
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert model.config.tie_word_embeddings
    assert len(tokenizer) == model.config.vocab_size == 49152
    assert tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "Hi"}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")

    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        ids = model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert "Paris" in tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :])
