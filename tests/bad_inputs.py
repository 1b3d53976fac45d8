"""The bad-input catalogue: every case is a command a user could type (and the files it reads), with what the
one-message answer must say. tests/unit/test_bad_inputs.py runs each case; `python -m tests.bad_inputs` runs them
all and writes docs/bad_inputs.md with the messages ds_exp actually prints."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.training import REPO, user_env
from tests.zygote import run_python

GOOD_ROW = {"prompt": "What is 2+2?", "chosen": "4"}
GOOD_CHAT = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}
DSCHAT_ROW = {"prompt": " Human: What is 2+2? Assistant:", "chosen": " 4", "rejected": " 5"}  # DeepSpeed-Chat's form


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # config value | combination | path | DeepSpeed JSON | data row | launch | sweep
    args: tuple[str, ...]  # after `python -m ds_exp`; {tmp} is the case's scratch directory
    expect: tuple[str, ...]  # fragments the message must hold (what is wrong, and the fix)
    files: dict[str, str | bytes] = field(default_factory=dict)  # name -> content, written into {tmp} first
    env: dict[str, str] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)  # name -> target ({tmp} allowed): symbolic links made first
    fifos: tuple[str, ...] = ()  # names of FIFOs (named pipes) made first: nothing ever writes to them
    run_dir: bool = True  # hydra.run.dir={tmp}/run is added unless the case names one; False: Hydra's own


# one cell of autotune's default grid (conf/experiment/autotune.yaml), the dimension under test added to it
ONE_CELL = ("zero=stage0", "offload=none", "train.micro_batch_size=4", "model.gradient_checkpointing=false")


def jsonl(*rows: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


# an lm-eval task YAML whose data are a local file (relative paths are taken from where the command runs)
HARNESS_TASK = (
    "task: qa\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: qa.jsonl\ntest_split: test\n"
    "output_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: choices\ndoc_to_target: answer\n"
)
HARNESS_ROWS = jsonl({"question": "2+2?", "choices": ["4", "5"], "answer": 0})


def local_data(name: str = "sft.jsonl") -> tuple[str, ...]:
    return ("data=local", f"data.sources.0.path={{tmp}}/{name}", "train.max_steps=2")


class FailingCallback:
    """A user's Hydra callback that raises (`+hydra.callbacks.mine._target_=tests.bad_inputs.FailingCallback`, with
    `+hydra.callbacks.mine.when=on_job_end` to fail once the job has run)."""

    def __init__(self, when: str = "on_job_start") -> None:
        self.when = when

    def on_job_start(self, **kwargs: Any) -> None:
        if self.when == "on_job_start":
            raise ValueError("my check refused this job")

    def on_job_end(self, **kwargs: Any) -> None:
        if self.when == "on_job_end":
            raise ValueError("my upload failed")


CASES: list[Case] = [
    # --- config values: the typed schema (while Hydra composes) and the semantic checks
    Case("micro batch 0", "config value", ("train.micro_batch_size=0",), ("train.micro_batch_size=0", ">= 1")),
    Case("micro batch not a number", "config value", ("train.micro_batch_size=abc",), ("train.micro_batch_size",)),
    Case("unknown key", "config value", ("train.micro_batchsize=4",), ("micro_batchsize",)),
    Case("unknown option", "config value", ("zero=stage5",), ("zero=stage5: zero has no option stage5", "stage3")),
    Case("bad enum value", "config value", ("precision.dtype=fp8",), ("fp8", "bf16")),
    Case(
        "data split of one number",
        "config value",
        ("data.data_split=10",),
        ("data.data_split=10: expected 3 proportions (phases 1, 2, 3), got 1", "write data.data_split=10,0,0"),
    ),
    Case(  # unquoted, Hydra would read it as a sweep over 2 and 4 ("Ambiguous value"): the CLI quotes it first
        "data split of two numbers",
        "config value",
        ("data.data_split=2,4",),
        ("data.data_split=2,4: expected 3 proportions (phases 1, 2, 3), got 2", "data.data_split=2,4,4"),
    ),
    Case("negative learning rate", "config value", ("optimizer.lr=-1",), ("optimizer.lr=-1", "must be > 0")),
    Case("beta out of range", "config value", ("optimizer.betas=[0.9,1.5]",), ("optimizer.betas", "[0, 1)")),
    Case("negative eps", "config value", ("optimizer.eps=0",), ("optimizer.eps=0", "must be > 0")),
    Case(
        "setting of another optimizer",
        "config value",
        ("optimizer=sgd", "optimizer.betas=[0.9,0.99]"),
        ("optimizer=sgd has no setting betas", "the optimizers that have it: adamw, adam, lion, muon"),
    ),
    Case(
        "8-bit AdamW without CUDA and bitsandbytes",
        "combination",
        ("optimizer=adamw_8bit",),
        ("optimizer=adamw_8bit needs a CUDA GPU and bitsandbytes", "use optimizer=adamw"),
    ),
    Case(
        "optimizer at a ZeRO stage it cannot run",
        "combination",
        ("optimizer=adafactor", "zero=stage2"),
        ("optimizer=adafactor at zero.stage=2", "use zero=stage0"),
    ),
    Case(
        "Muon with CPU offload",
        "combination",
        ("optimizer=muon", "zero=stage2", "offload=cpu", "train.gradient_clipping=0"),
        ("optimizer=muon with offload.optimizer=cpu", "DeepSpeed RFC #8463", "use offload=none"),
    ),
    Case("negative LoRA dim", "config value", ("lora.dim=-4",), ("lora.dim=-4", "lora.dim=64")),
    Case("LoRA dropout 1.5", "config value", ("lora.dim=8", "lora.dropout=1.5"), ("lora.dropout=1.5", "[0, 1)")),
    Case(
        "LoRA target matches no layer",
        "config value",
        ("lora.dim=8", "lora.target_modules=[qkv_proj]", "train.max_steps=2"),
        ("lora.target_modules: qkv_proj matches no Linear layer", "q_proj", "down_proj"),
    ),
    Case(
        "LoRA target not a regex",
        "config value",
        ("lora.dim=8", "lora.target_modules='(q'"),
        ("lora.target_modules='(q' is not a valid regular expression", "[q_proj,v_proj]"),
    ),
    Case(
        "LoRA option while LoRA is off",
        "combination",
        ("lora.use_dora=true",),
        ("lora.use_dora is set but LoRA is off (lora.dim=0)", "lora.dim=16"),
    ),
    Case(
        "QLoRA without CUDA",
        "combination",
        ("lora.dim=8", "lora.quantize=4bit"),
        ("lora.quantize=4bit (QLoRA) needs a CUDA GPU and bitsandbytes", "lora.quantize=null"),
    ),
    Case(
        "MLflow file store",
        "config value",
        ("logger=mlflow", "logger.mlflow.tracking_uri={tmp}/mlruns"),
        ("is MLflow's file store", "sqlite:///", "MLFLOW_ALLOW_FILE_STORE=true"),
    ),
    Case("warmup ratio 1.5", "config value", ("scheduler.warmup_ratio=1.5",), ("scheduler.warmup_ratio", "[0, 1)")),
    Case("max_steps 0", "config value", ("train.max_steps=0",), ("train.max_steps=0", "-1")),
    Case("negative clipping", "config value", ("train.gradient_clipping=-1",), ("train.gradient_clipping", ">= 0")),
    Case("timeout 0", "config value", ("dist.timeout_minutes=0",), ("dist.timeout_minutes=0", "from 1 to 525600")),
    Case("max_bad_steps negative", "config value", ("train.max_bad_steps=-1",), ("train.max_bad_steps=-1", ">= 0")),
    Case("export_every negative", "config value", ("train.export_every=-1",), ("train.export_every=-1", ">= 0")),
    Case("negative temperature", "config value", ("eval.temperature=-1",), ("eval.temperature=-1.0", "0 = greedy")),
    Case("top_p 1.5", "config value", ("eval.temperature=0.7", "eval.top_p=1.5"), ("eval.top_p=1.5", "(0, 1]")),
    Case(
        "top_k while greedy",
        "combination",
        ("eval.top_k=5",),
        ("eval.top_k=5 has no effect with eval.temperature=0", "eval.temperature > 0"),
    ),
    Case(
        "unknown row layout",
        "config value",
        (*local_data(), "data.sources.0.layout=xml"),
        ("data.sources[0].layout=xml", "prompt_chosen, messages, sharegpt, alpaca"),
        files={"sft.jsonl": jsonl(GOOD_ROW)},
    ),
    # --- combinations
    Case(
        "parameter offload below stage 3",
        "combination",
        ("zero=stage2", "offload=cpu_all"),
        ("offload.param=cpu needs ZeRO stage 3", "zero=stage3"),
    ),
    Case(
        "optimizer offload at stage 0",
        "combination",
        ("zero=stage0", "offload=cpu"),
        ("offload.optimizer=cpu needs ZeRO stage 1", "zero=stage1"),
    ),
    Case("NVMe offload without a path", "combination", ("zero=stage3", "offload=nvme"), ("offload.nvme_path",)),
    Case("fp16 on a CPU", "combination", ("precision=fp16",), ("precision=fp16", "precision=bf16")),
    Case(
        "warmup steps and ratio",
        "combination",
        ("scheduler.warmup_steps=10", "scheduler.warmup_ratio=0.1"),
        ("both set", "keep one"),
    ),
    Case(
        "DeepSpeed-owned polynomial schedule",
        "combination",
        ("scheduler=polynomial", "scheduler.owner=deepspeed"),
        ("no DeepSpeed equivalent", "scheduler.owner=ds_exp"),
    ),
    Case(
        "global batch not a multiple",
        "combination",
        ("train.global_batch_size=30", "train.micro_batch_size=16"),
        ("train.global_batch_size=30", "use auto"),
    ),
    # --- paths
    Case(
        "model directory missing",
        "path",
        ("model.name_or_path=/nonexistent/model",),
        ("model.name_or_path=/nonexistent/model", "directory not found"),
    ),
    Case(
        "model directory without config.json",
        "path",
        ("model.name_or_path={tmp}/empty_model",),
        ("has no config.json", "Hugging Face checkpoint directory"),
        files={"empty_model/README": "not a model\n"},
    ),
    Case("resume path missing", "path", ("resume=/nonexistent/run",), ("resume=/nonexistent/run", "resume=auto")),
    Case(
        "resume from a run without checkpoints",
        "path",
        ("resume={tmp}/old_run",),
        ("no complete checkpoint", "step<N>"),
        files={"old_run/metrics.jsonl": ""},
    ),
    Case(
        "resume from an incomplete checkpoint",
        "path",
        ("resume={tmp}/old_run/checkpoints/step4",),
        ("step4 is not a complete checkpoint (it has no ds_exp_complete.json", "resume=<run dir>"),
        files={"old_run/checkpoints/step4/mp_rank_00_model_states.pt": b"cut short by a kill"},
    ),
    Case(
        "run directory under a file",
        "path",
        ("hydra.run.dir={tmp}/a_file/run",),
        ("hydra.run.dir", "is a file, not a directory"),
        files={"a_file": "x\n"},
    ),
    Case(
        "data file missing",
        "path",
        local_data("missing.jsonl"),
        ("data.sources[0].path=", "missing.jsonl: file not found", "fix the path"),
    ),
    # --- DeepSpeed JSON files
    Case(
        "DeepSpeed config missing",
        "DeepSpeed JSON",
        ("deepspeed.config_file={tmp}/nope.json",),
        ("deepspeed.config_file", "file not found"),
    ),
    Case(
        "DeepSpeed config not JSON",
        "DeepSpeed JSON",
        ("deepspeed.config_file={tmp}/ds.json",),
        ("is not valid JSON", "line 1"),
        files={"ds.json": '{"zero_optimization": {"stage": 2,}}\n'},
    ),
    Case(
        "DeepSpeed config a list",
        "DeepSpeed JSON",
        ("deepspeed.config_file={tmp}/ds.json",),
        ("top level must be a JSON object",),
        files={"ds.json": "[1, 2]\n"},
    ),
    Case(
        "DeepSpeed config disagrees",
        "DeepSpeed JSON",
        ("deepspeed.config_file={tmp}/ds.json", "train.micro_batch_size=4"),
        ("train_micro_batch_size_per_gpu=3", '"auto"'),
        files={"ds.json": json.dumps({"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.5})},
    ),
    Case(
        "DeepSpeed config fp16 and bf16",
        "DeepSpeed JSON",
        ("deepspeed.config_file={tmp}/ds.json",),
        ("fp16.enabled and bf16.enabled are both true", "pick one"),
        files={"ds.json": json.dumps({"fp16": {"enabled": True}, "bf16": {"enabled": True}})},
    ),
    Case(
        "DeepSpeed config ZeRO stage 7",
        "DeepSpeed JSON",
        ("deepspeed.config_file={tmp}/ds.json",),
        ("ZeRO stage must be 0, 1, 2 or 3",),
        files={"ds.json": json.dumps({"zero_optimization": {"stage": 7}})},
    ),
    # --- data rows (read once the run starts, before the model is built)
    Case(
        "malformed JSON line",
        "data row",
        local_data(),
        ("sft.jsonl:2", "not valid JSON"),
        files={"sft.jsonl": jsonl(GOOD_ROW, '{"prompt": "x", "chosen": ', GOOD_ROW)},
    ),
    Case(
        "row not an object",
        "data row",
        local_data(),
        ("sft.jsonl:2", "expected a JSON object per line"),
        files={"sft.jsonl": jsonl(GOOD_ROW, "[1, 2]", GOOD_ROW)},
    ),
    Case(
        "prompt column missing",
        "data row",
        local_data(),
        ("prompt_field=prompt", "column not found", "question"),
        files={"sft.jsonl": jsonl({"question": "q", "chosen": "a"}, {"question": "r", "chosen": "b"})},
    ),
    Case(
        "non-text prompt",
        "data row",
        local_data(),
        ("prompt_field", "not text", "point the field at a text column"),
        files={"sft.jsonl": jsonl(*({"prompt": {"text": f"q{i}"}, "chosen": "a"} for i in range(40)))},
    ),
    Case(
        "DeepSpeed-Chat rows wrapped twice",
        "data row",
        (*local_data(), "data.template=dschat"),
        ("already carry DeepSpeed-Chat's markers", "sft.jsonl:1", "data.template=raw"),
        files={"sft.jsonl": jsonl(*[DSCHAT_ROW] * 40)},
    ),
    Case(
        "unknown chat role",
        "data row",
        local_data(),
        ("sft.jsonl:2", "unknown role 'bot'", "use one of system, user (human), assistant (gpt)"),
        files={"sft.jsonl": jsonl(GOOD_CHAT, {"messages": [{"role": "bot", "content": "hi"}]}, GOOD_CHAT)},
    ),
    Case(
        "empty conversation",
        "data row",
        local_data(),
        ("sft.jsonl:3", "empty conversation", "remove the row"),
        files={"sft.jsonl": jsonl(GOOD_CHAT, GOOD_CHAT, {"messages": []})},
    ),
    Case(
        "conversation without an answer",
        "data row",
        local_data(),
        ("sft.jsonl:2", "no assistant turn", "add the answer as an assistant turn"),
        files={"sft.jsonl": jsonl(GOOD_CHAT, {"messages": [{"role": "user", "content": "hi"}]})},
    ),
    Case(
        "chat content not text",
        "data row",
        local_data("sft.json"),
        ("sft.json: item 1", "turn 1 (gpt) content is dict, not a string"),
        files={
            "sft.json": json.dumps(
                [
                    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
                    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": {"text": "x"}}]},
                ]
            )
        },
    ),
    Case(
        "fewer rows than one batch",
        "data row",
        local_data(),
        ("fewer than one global batch", "lower train.micro_batch_size or add data"),
        files={"sft.jsonl": jsonl(GOOD_ROW, GOOD_ROW, GOOD_ROW)},
    ),
    Case(
        "max_seq_len too short",
        "data row",
        ("data.max_seq_len=4", "train.max_steps=2"),
        ("data.max_seq_len=4", "raise data.max_seq_len"),
    ),
    # --- launch
    Case(
        "sweep under torchrun",
        "launch",
        ("-m", "zero=stage0,stage1"),
        ("-m/--multirun under torchrun", "hydra/launcher=slurm"),
        env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
    ),
    # --- issue 14: launch variables, output paths, DeepSpeed keys, schedules
    Case(
        "WORLD_SIZE without RANK",
        "launch",
        ("train.max_steps=2",),
        ("WORLD_SIZE=2 is set but RANK is not", "torchrun --nproc_per_node 2", "unset WORLD_SIZE"),
        env={"WORLD_SIZE": "2"},
    ),
    Case(
        "RANK beyond WORLD_SIZE",
        "launch",
        ("train.max_steps=2",),
        ("RANK=3 with WORLD_SIZE=2", "ranks go from 0 to 1"),
        env={"RANK": "3", "WORLD_SIZE": "2"},
    ),
    Case(
        "RANK without WORLD_SIZE",
        "launch",
        ("train.max_steps=2",),
        ("RANK=1 is set but WORLD_SIZE is not",),
        env={"RANK": "1"},
    ),
    Case(
        "nccl without GPUs",
        "launch",
        ("dist.backend=nccl", "train.max_steps=2"),
        ("dist.backend=nccl needs NVIDIA GPUs", "dist.backend=auto"),
    ),
    Case(
        "mpi backend missing from torch",
        "launch",
        ("dist.backend=mpi", "train.max_steps=2"),
        ("dist.backend=mpi needs a torch built with MPI", "dist.backend=auto"),
    ),
    Case(
        "checkpoint_dir outside the run",
        "path",
        ("train.checkpoint_dir=/tmp/elsewhere",),
        ("train.checkpoint_dir=/tmp/elsewhere", "inside the run directory", "train.allow_outside_run_dir=true"),
    ),
    Case(
        "export_dir climbing out of the run",
        "path",
        ("train.export_dir=../../x",),
        ("train.export_dir=../../x", "no '..'", "train.allow_outside_run_dir=true"),
    ),
    Case(
        "export_dir onto a directory that is not an export",
        "path",
        ("train.max_steps=2", "train.allow_outside_run_dir=true", "train.export_dir={tmp}/mine"),
        ("mine exists and is not an export of a ds_exp run", "point train.export_dir elsewhere"),
        files={"mine/notes.txt": "a user's own file"},
    ),
    Case(
        "misspelt key in a DeepSpeed JSON block",
        "DeepSpeed JSON",
        ("deepspeed.config_file={tmp}/ds.json", "train.max_steps=2"),
        ("zero_optimization.overlap_com: DeepSpeed has no such key", "deepspeed.config_file="),
        files={"ds.json": json.dumps({"zero_optimization": {"stage": 2, "overlap_com": True}})},
    ),
    Case(
        "flash attention without flash-attn or a GPU",
        "combination",
        ("model.attn_implementation=flash_attention_2",),
        ("model.attn_implementation=flash_attention_2 needs a CUDA GPU", "model.attn_implementation=auto"),
    ),
    # --- the fast path (issue 32): each knob auto | true | false; true where it cannot run is refused with the fix
    Case(
        "a fast-path knob that is not auto, true or false",
        "config value",
        ("model.fused_loss=sometimes",),
        ("model.fused_loss=sometimes: expected auto, true or false",),
    ),
    Case(
        "Liger's fused loss asked for on a CPU",
        "combination",
        ("model.fused_loss=true",),
        ("model.fused_loss=true: Liger's fused linear cross-entropy is a Triton GPU kernel and this is cpu", "auto"),
        env={"TRITON_INTERPRET": "0"},  # the interpreter (tests/unit/test_fast_path.py's) would run it on the host
    ),
    # --- sequence parallelism (dist.sequence_parallel_size, issue 24): refused before anything heavy
    Case(
        "sequence parallel size not dividing the world size",
        "combination",
        ("dist.sequence_parallel_size=2",),
        ("dist.sequence_parallel_size=2 does not divide the world size 1", "torchrun --nproc_per_node 2"),
    ),
    Case(
        "sequence parallel size not dividing the attention heads",
        "combination",
        ("dist.sequence_parallel_size=3",),
        ("does not divide the model's 4 attention heads (model.arch)", "divides 4 (2, 4)"),
    ),
    Case(
        "eager attention under sequence parallelism",
        "combination",
        ("dist.sequence_parallel_size=2", "model.attn_implementation=eager"),
        ("model.attn_implementation=eager cannot run under dist.sequence_parallel_size=2", "attn_implementation=sdpa"),
    ),
    Case(
        "packed documents with flex attention under sequence parallelism",
        "combination",
        ("dist.sequence_parallel_size=2", "data.packing=true", "model.attn_implementation=flex_attention"),
        ("packed documents would attend to each other", "model.attn_implementation=sdpa or flash_attention_2"),
    ),
    Case(
        "warmup longer than the run",
        "combination",
        ("train.max_steps=5", "scheduler.warmup_steps=50"),
        ("scheduler.warmup_steps=50 is longer than the whole run (5 optimizer steps)", "scheduler.warmup_ratio"),
    ),
    Case(
        "global batch of another world size",
        "combination",
        ("train.global_batch_size=32", "train.micro_batch_size=8"),
        ("train.global_batch_size=32 holds only at world size 4", "this launch has 1 rank", "auto"),
    ),
    Case(
        "a fresh run into a directory that holds a run",
        "path",
        ("hydra.run.dir={tmp}/done", "train.max_steps=2"),
        ("already holds a run (summary.json: status failed at step 10)", "nothing was changed", "resume=auto"),
        files={"done/summary.json": json.dumps({"status": "failed", "steps": 10})},
    ),
    # --- issue 14: data files, paths, model checkpoints
    Case(
        "repeated key in a JSON line",
        "data row",
        local_data(),
        ("sft.jsonl:2", "the key 'prompt' appears twice", "remove or rename one of them"),
        files={"sft.jsonl": jsonl(GOOD_ROW, '{"prompt": "a", "prompt": "b", "chosen": "c"}', GOOD_ROW)},
    ),
    Case(
        "repeated key in a JSON array item",
        "data row",
        local_data("sft.json"),
        ("sft.json: item 1", "the key 'content' appears twice", "remove or rename one of them"),
        files={"sft.json": json.dumps([GOOD_CHAT, GOOD_CHAT])[:-4] + ', "content": "5"}]}]'},
    ),
    Case(
        "repeated CSV column",
        "data row",
        local_data("sft.csv"),
        ("sft.csv: the column prompt appears more than once", "rename the columns"),
        files={"sft.csv": "prompt,chosen,prompt\nWhat is 2+2?,4,x\n"},
    ),
    Case(
        "gzip file named .jsonl",
        "path",
        local_data(),
        ("sft.jsonl is gzip-compressed", "rename it to sft.jsonl.gz"),
        files={"sft.jsonl": gzip.compress(jsonl(GOOD_ROW).encode(), mtime=0)},
    ),
    Case(
        "damaged gzip file",
        "path",
        local_data("sft.jsonl.gz"),
        ("sft.jsonl.gz is a damaged gzip file", "compress or copy it again"),
        files={"sft.jsonl.gz": gzip.compress(jsonl(*[GOOD_ROW] * 50).encode(), mtime=0)[:40]},
    ),
    Case(
        "Parquet file named .jsonl",
        "path",
        local_data(),
        ("sft.jsonl is a Parquet file", "format=parquet"),
        files={"sft.jsonl": b"PAR1\x15\x04\x15\x10" + bytes(32) + b"PAR1"},
    ),
    Case(
        "zip archive named .jsonl",
        "path",
        local_data(),
        ("sft.jsonl is a zip archive", "unzip it"),
        files={"sft.jsonl": b"PK\x03\x04\x14\x00" + bytes(32)},
    ),
    Case(
        "data cache directory is a file",
        "path",
        (),  # run_case points data.cache_dir at {tmp}/cache
        ("data.cache_dir=", "is a file, not a directory", "point data.cache_dir at a directory"),
        files={"cache": "not a directory\n"},
    ),
    Case(
        "NVMe path is a file",
        "path",
        ("zero=stage3", "offload=nvme", "offload.nvme_path={tmp}/nvme"),
        ("offload.nvme_path=", "is a file, not a directory", "point offload.nvme_path at a directory"),
        files={"nvme": "not a directory\n"},
    ),
    Case(
        "max_seq_len beyond learned positions",
        "combination",
        ("model=local", "model.name_or_path={tmp}/opt", "data.max_seq_len=256"),
        ("data.max_seq_len=256 is beyond the model's 128 positions", "set data.max_seq_len=128"),
        files={
            "opt/config.json": json.dumps({"model_type": "opt", "hidden_size": 64, "max_position_embeddings": 128}),
            "opt/model.safetensors": b"\x02\x00\x00\x00\x00\x00\x00\x00{}",  # a complete file holding no tensor
        },
    ),
    Case(
        "model config.json not JSON",
        "path",
        ("model=local", "model.name_or_path={tmp}/model"),
        ("config.json is not valid JSON (line 1 column", "fix or replace the file"),
        files={"model/config.json": '{"model_type": "llama", "hidden_size": 64,}\n'},
    ),
    Case(
        "unknown model_type",
        "path",
        ("model=local", "model.name_or_path={tmp}/model", f"model.tokenizer={REPO / 'ds_exp/assets/tokenizer'}"),
        ("model_type=mystery_lm, which transformers", "upgrade transformers"),
        files={
            "model/config.json": json.dumps({"model_type": "mystery_lm", "hidden_size": 64}),
            "model/model.safetensors": b"\x02\x00\x00\x00\x00\x00\x00\x00{}",
        },
    ),
    Case(
        "checkpoint with its own code",
        "path",
        ("model=local", "model.name_or_path={tmp}/model", f"model.tokenizer={REPO / 'ds_exp/assets/tokenizer'}"),
        ("ships its own model code (auto_map in config.json)", "model.trust_remote_code=true runs that code"),
        files={
            "model/config.json": json.dumps(
                {"model_type": "mystery_lm", "auto_map": {"AutoConfig": "configuration_mystery.MysteryConfig"}}
            ),
            "model/configuration_mystery.py": "raise SystemExit('ds_exp ran code it was not allowed to run')\n",
            "model/model.safetensors": b"\x02\x00\x00\x00\x00\x00\x00\x00{}",
        },
    ),
    Case(
        "checkpoint without weights",
        "path",
        ("model=local", "model.name_or_path={tmp}/model"),
        ("no weights file (model.safetensors", "copy the checkpoint's weights there"),
        files={"model/config.json": json.dumps({"model_type": "llama", "hidden_size": 64})},
    ),
    Case(
        "truncated weights file",
        "path",
        ("model=local", "model.name_or_path={tmp}/model"),
        ("model.safetensors is cut short", "download or copy it again"),
        files={
            "model/config.json": json.dumps({"model_type": "llama", "hidden_size": 64}),
            # a 58-byte header announcing 400 bytes of float32 data, and 16 of them
            "model/model.safetensors": b"\x3a\x00\x00\x00\x00\x00\x00\x00"
            + b'{"w":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}}'
            + bytes(16),
        },
    ),
    # --- long context (ds_exp/long_context/, model.rope_scaling)
    Case(
        "activation offload without checkpointing",
        "combination",
        ("model.activation_offload=true",),
        (
            "model.activation_offload=true keeps what activation checkpointing saves",
            "model.gradient_checkpointing=true",
        ),
    ),
    Case(
        "tiled MLP with no tiles",
        "config value",
        ("model.tiled_mlp=true", "model.tiled_mlp_shards=0"),
        ("model.tiled_mlp_shards=0: must be >= 1, or null to derive it",),
    ),
    Case(
        "tiled loss on a model that soft-caps its logits",
        "combination",
        ("model.tiled_loss=true", "+model.arch.final_logit_softcapping=30.0"),
        ("this model changes its logits after lm_head (final_logit_softcapping=30.0)", "set model.tiled_loss=false"),
    ),
    Case(
        "rope scaling without a type",
        "config value",
        ("model.rope_scaling={factor:4.0}",),
        ("model.rope_scaling={factor:4.0}: name the scaling with rope_type", "e.g. rope_type:yarn"),
    ),
    Case(
        "rope scaling on learned positions",
        "combination",
        ("model=local", "model.name_or_path={tmp}/opt", "model.rope_scaling={rope_type:linear,factor:2.0}"),
        ("learned a table of absolute positions, it has no rotary embeddings to scale", "remove model.rope_scaling"),
        files={
            "opt/config.json": json.dumps({"model_type": "opt", "hidden_size": 64, "max_position_embeddings": 128}),
            "opt/model.safetensors": b"\x02\x00\x00\x00\x00\x00\x00\x00{}",  # a complete file holding no tensor
        },
    ),
    # --- sweeps that decide (autotune, optuna): refused before any job is launched. The parity check's refusals
    # (python -m ds_exp.parity) are tested in tests/integration/test_parity.py.
    Case(
        "autotune budget nothing fits",
        "sweep",
        ("-m", "experiment=autotune", "hydra.sweeper.memory_budget=1MiB"),
        ("experiment=autotune: nothing fits the memory budget of 1.00 MiB per",),
    ),
    Case(  # the estimate counts each optimizer's state: Adafactor's is the smallest
        "autotune over optimizers, nothing fits",
        "sweep",
        ("-m", "experiment=autotune", "hydra.sweeper.memory_budget=1MiB", "optimizer=adamw,lion,adafactor", *ONE_CELL),
        ("nothing fits the memory budget of 1.00 MiB", "experiment=autotune optimizer=adafactor data.cache_dir="),
    ),
    Case(
        "a sweep over optimizers with a job that cannot run",
        "sweep",
        ("-m", "optimizer=adamw,lion,muon", "zero=stage2"),
        ("the sweep was not started", "job [optimizer=muon zero=stage2 ", "set train.gradient_clipping=0"),
    ),
    Case(
        "autotune budget not a size",
        "sweep",
        ("-m", "experiment=autotune", "hydra.sweeper.memory_budget=lots"),
        ("hydra.sweeper.memory_budget=lots: expected auto or a positive size",),
    ),
    Case(
        "optuna without a search space",
        "sweep",
        ("-m", "hydra/sweeper=optuna", "optimizer.lr=1e-4"),
        ("hydra/sweeper=optuna needs a search space",),
    ),
    Case(
        "optuna empty interval",
        "sweep",
        ("-m", "hydra/sweeper=optuna", "optimizer.lr=interval(1e-3,1e-5)"),
        ("interval(0.001, 1e-05) is empty",),
    ),
    # --- issue 21: tracebacks and silent acceptances turned into one message each
    Case("hidden size 0", "config value", ("model.arch.hidden_size=0",), ("model.arch.hidden_size=0", "> 0")),
    Case(
        "heads not dividing the hidden size",
        "config value",
        ("model.arch.num_attention_heads=3",),
        ("model.arch.hidden_size=128 is not a multiple of model.arch.num_attention_heads=3", "a divisor of 128"),
    ),
    Case(
        "timeout beyond a year",
        "config value",
        ("dist.timeout_minutes=2000000000000000",),
        ("dist.timeout_minutes=2000000000000000", "to 525600"),
    ),
    Case(
        "learning rate beyond float32",
        "config value",
        ("optimizer.lr=3e38",),
        ("optimizer.lr=3e+38", "beyond the largest float32 number"),
    ),
    Case(
        "Muon's AdamW learning rate beyond float32",
        "config value",
        ("optimizer=muon", "optimizer.adam_lr=1e39"),
        ("optimizer.adam_lr=1e+39: must be at most 3.403e+38, the largest float32 number",),
    ),
    Case(
        "weight decay beyond float32",
        "config value",
        ("optimizer=sgd", "optimizer.weight_decay=1e39"),
        ("optimizer.weight_decay=1e+39: must be at most 3.403e+38",),
    ),
    Case(
        "data split beyond float32",
        "config value",
        ("data.data_split=1e308,1e308,1e308",),
        ("data.data_split=1e308,1e308,1e308: proportions must be numbers from 0 to 3.403e+38",),
    ),
    Case(
        "MASTER_PORT not a port",
        "launch",
        ("train.max_steps=2",),
        ("MASTER_PORT=99999 is not a TCP port", "1 to 65535"),
        env={"MASTER_PORT": "99999"},
    ),
    Case(
        "run directory name too long",
        "path",
        ("hydra.run.dir={tmp}/" + "x" * 300,),
        ("hydra.run.dir=", "has 300 bytes", "NAME_MAX", "choose a shorter hydra.run.dir"),
    ),
    Case(
        "checkpoints inside the export",
        "path",
        ("train.checkpoint_dir=hf_model/ckpts",),
        ("train.checkpoint_dir=hf_model/ckpts is inside train.export_dir=hf_model", "train.checkpoint_dir=checkpoints"),
    ),
    Case(
        "offload at stage 0 in a DeepSpeed JSON",
        "DeepSpeed JSON",
        ("deepspeed.config_file={tmp}/ds.json",),
        (
            '"zero_optimization.offload_optimizer.device": "cpu" in deepspeed.config_file=',
            'set "zero_optimization.stage" to 1, 2 or 3 there, or remove "offload_optimizer" from it',
        ),
        files={"ds.json": json.dumps({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})},
    ),
    Case(
        "generation past learned positions",
        "combination",
        (
            "model.arch.model_type=opt",
            "model.arch.max_position_embeddings=40",
            "data.max_seq_len=32",
            "data.synthetic.num_train=64",
            "data.synthetic.num_eval=8",
            'eval.prompts=["Tell me a story about a cat who plays the piano"]',
            "eval.max_new_tokens=30",
        ),
        ("eval.prompts[0] is 26 tokens", "beyond the model's 40 positions", "set eval.max_new_tokens=14 or lower"),
    ),
    Case(
        "empty eval.json",
        "data row",
        ("data=dschat_local", "data.sources.0.path={tmp}/dschat", "train.max_steps=2"),
        ("dschat/eval.json holds no eval rows", "delete it", "data.sources.0.eval_split=null"),
        files={"dschat/train.json": json.dumps([DSCHAT_ROW] * 40), "dschat/eval.json": ""},
    ),
    Case(
        "file mixing chat layouts",
        "data row",
        local_data(),
        ("mixes row layouts: messages at lines 1-2, 4 (3 rows); sharegpt at line 3", "data.sources.0.layout=messages"),
        files={
            "sft.jsonl": jsonl(
                GOOD_CHAT,
                GOOD_CHAT,
                {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
                GOOD_CHAT,
            )
        },
    ),
    Case(
        "optuna storage without its driver",
        "sweep",
        ("-m", "hydra/sweeper=optuna", "optimizer.lr=interval(1e-5,1e-3)", "hydra.sweeper.storage=mysql://u:pw@db/x"),
        ("hydra.sweeper.storage=mysql://u:***@db/x", "is not installed", "pip install mysqlclient"),
    ),
    # --- issue 21: the run directory's lock, and keys a DeepSpeed file wins over
    Case(
        "lock file a dangling link",
        "path",
        ("train.max_steps=2",),
        ("run/.ds_exp.lock is a symbolic link", "which does not exist", "remove the link"),
        links={"run/.ds_exp.lock": "{tmp}/gone"},
    ),
    Case(
        "lock file a directory",
        "path",
        ("train.max_steps=2",),
        ("run/.ds_exp.lock is a directory, not ds_exp's lock file", "Move it out of the run directory"),
        files={"run/.ds_exp.lock/stray": ""},
    ),
    Case(
        "override a DeepSpeed JSON wins over",
        "DeepSpeed JSON",
        ("zero=stage1", "deepspeed.config_file={tmp}/ds.json", "train.max_steps=2"),
        ("zero=stage1 would not be used", "ds.json sets zero_optimization.stage=3", "remove zero_optimization.stage"),
        files={"ds.json": json.dumps({"zero_optimization": {"stage": 3}})},
    ),
    Case(
        "optimizer setting a DeepSpeed optimizer block leaves out",
        "DeepSpeed JSON",
        ("optimizer.lr=1e-4", "deepspeed.config_file={tmp}/ds.json", "train.max_steps=2"),
        ("optimizer.lr=1e-4 would not be used", "params have no lr", '"lr": "auto"'),
        files={"ds.json": json.dumps({"optimizer": {"type": "AdamW", "params": {"weight_decay": "auto"}}})},
    ),
    Case(
        "sweep over a key a DeepSpeed JSON sets",
        "sweep",
        ("-m", "zero=stage1,stage3", "deepspeed.config_file={tmp}/ds.json", "train.max_steps=2"),
        ("the sweep was not started", "zero=stage1 would not be used", "zero_optimization.stage=3"),
        files={"ds.json": json.dumps({"zero_optimization": {"stage": 3}})},
    ),
    Case(
        "autotune over a key a DeepSpeed JSON sets",
        "sweep",
        ("-m", "experiment=autotune", "zero=stage0,stage1", "deepspeed.config_file={tmp}/ds.json"),
        ("zero=stage0 would not be used", "zero=stage1 would not be used", "zero_optimization.stage=3"),
        files={"ds.json": json.dumps({"zero_optimization": {"stage": 3}})},
    ),
    Case(
        "optuna search over a key a DeepSpeed JSON sets",
        "sweep",
        ("-m", "hydra/sweeper=optuna", "zero=stage1,stage3", "deepspeed.config_file={tmp}/ds.json"),
        ("hydra/sweeper=optuna: zero=stage1 would not be used", "zero_optimization.stage=3"),
        files={"ds.json": json.dumps({"zero_optimization": {"stage": 3}})},
    ),
    Case(
        "autotune probes too short to time",
        "sweep",
        ("-m", "experiment=autotune", "train.max_steps=1"),
        ("train.max_steps=1 with train.log_every=1", "give train.max_steps > 1"),
    ),
    Case(  # validation cannot tell (the steps of a run without train.max_steps need the data); the run's plan can
        "autotune probes shorter than their warmup",
        "sweep",
        ("-m", "experiment=autotune", "scheduler.warmup_steps=10"),
        (
            "none of the 32 candidates is a valid configuration",
            "scheduler.warmup_steps=10 is longer than the whole run (6 optimizer steps)",
        ),
    ),
    Case(
        "autotune max_batch_size -1",
        "sweep",
        ("-m", "experiment=autotune", "hydra.sweeper.max_batch_size=-1"),
        ("hydra.sweeper.max_batch_size=-1", "a whole number >= 1, or null"),
    ),
    Case(
        "SLURM launcher without SLURM",
        "launch",
        ("-m", "hydra/launcher=slurm", "train.max_steps=2"),
        ("hydra/launcher=slurm: sbatch and srun not found", "nothing was submitted", "hydra/launcher=local"),
        env={"PATH": "/nonexistent"},  # no srun, no sbatch
    ),
    Case(
        "WSD decay longer than the run",
        "combination",
        ("scheduler=warmup_stable_decay", "train.max_steps=40", "scheduler.kwargs.num_decay_steps=100"),
        ("num_decay_steps=100 with 0 warmup steps does not fit in the run's 40", "num_decay_steps=auto"),
    ),
    Case(
        "list item a data option lacks",
        "config value",
        ("experiment=dschat_step1", "data.sources.0.path={tmp}/data"),
        ("data=synthetic has no data.sources[0]", "data=dschat_local data.sources.0.path="),
    ),
    Case(
        "a key ds_exp no longer has",
        "config value",
        ("lora.dim=8", "train.export_adapter=true"),
        ("train.export_adapter is no more", "every export writes the adapter", "train.export_merged=end|every|none"),
    ),
    Case(
        "hub id with no hub to reach",
        "path",
        ("model.name_or_path=meta-llama/Llama-2-7b-hf",),
        ("is a Hugging Face hub id, the hub cannot be reached", "hf download meta-llama/Llama-2-7b-hf --local-dir DIR"),
        env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": "/nonexistent/hf_cache"},  # nothing listens there
    ),
    # --- issue 31 §1/§10: a user's shell (HF_HUB_OFFLINE=1, HF_HOME elsewhere) gets messages as good as any
    Case(
        "hub id with the hub offline in the user's shell",
        "path",
        ("model.name_or_path=meta-llama/Llama-2-7b-hf",),
        (
            "model.name_or_path=meta-llama/Llama-2-7b-hf is a Hugging Face hub id, HF_HUB_OFFLINE=1 is set",
            "(/nonexistent/hf_home/hub, from HF_HOME)",
            "hf download meta-llama/Llama-2-7b-hf --local-dir DIR",
            "or unset HF_HUB_OFFLINE",
        ),
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": "/nonexistent/hf_home"},
    ),
    # --- issue 31 §3: every wait on something outside the process is bounded and announced (paths that would block
    # or never end, tracker servers that do not answer: told before anything opens or waits on them)
    Case(
        "data file a FIFO",
        "path",
        local_data("pipe.jsonl"),
        ("data.sources[0].path: ", "pipe.jsonl is a FIFO (named pipe)", "give the path of a regular file"),
        fifos=("pipe.jsonl",),
    ),
    Case(
        "data file a device",
        "path",
        local_data("zero.jsonl"),
        ("data.sources[0].path: ", "zero.jsonl is a character device", "give the path of a regular file"),
        links={"zero.jsonl": "/dev/zero"},
    ),
    Case(
        "eval file a FIFO",
        "path",
        (*local_data(), "data.sources.0.eval_path={tmp}/eval.jsonl"),
        ("data.sources[0].eval_path: ", "eval.jsonl is a FIFO (named pipe)"),
        files={"sft.jsonl": jsonl(*[GOOD_ROW] * 8)},
        fifos=("eval.jsonl",),
    ),
    Case(
        "DeepSpeed config a FIFO",
        "DeepSpeed JSON",
        ("deepspeed.config_file={tmp}/ds.json",),
        ("deepspeed.config_file: ", "ds.json is a FIFO (named pipe)", "give the path of a regular file"),
        fifos=("ds.json",),
    ),
    Case(
        "model path a device",
        "path",
        ("model.name_or_path=/dev/zero",),
        ("model.name_or_path: /dev/zero is a character device", "give the path of a regular file"),
    ),
    Case(
        "prompts file a FIFO",
        "path",
        ("eval.prompts_file={tmp}/prompts.txt",),
        ("eval.prompts_file: ", "prompts.txt is a FIFO (named pipe)"),
        fifos=("prompts.txt",),
    ),
    Case(
        "MLflow server not answering",
        "config value",
        ("logger=mlflow", "logger.mlflow.tracking_uri=http://ds:hunter2@127.0.0.1:9"),  # nothing listens on port 9
        ("logger.mlflow.tracking_uri=http://ds:***@127.0.0.1:9: the server cannot be reached", "enabled=false"),
    ),
    Case(
        "wandb server not answering",
        "config value",
        ("logger=wandb", "logger.wandb.mode=online"),
        ("logger.wandb.mode=online (WANDB_BASE_URL=http://127.0.0.1:9)", "cannot be reached", "mode=offline"),
        env={"WANDB_BASE_URL": "http://127.0.0.1:9"},
    ),
    # --- issue 31 §4/§6: experiment files as safe as the command line, and where a run's name puts it
    Case(
        "experiment file not YAML",
        "path",
        ("--config-dir", "{tmp}/conf", "experiment=broken"),
        ("conf/experiment/broken.yaml: not valid YAML at line 3", "fix that line"),
        files={"conf/experiment/broken.yaml": "# @package _global_\ntrain: {max_steps: 2\n"},
    ),
    Case(
        "experiment file with a key given twice",
        "path",
        ("--config-dir", "{tmp}/conf", "experiment=twice"),
        ("conf/experiment/twice.yaml: `max_steps` is given twice in one mapping (lines 3 and 4)", "keep one"),
        files={"conf/experiment/twice.yaml": "# @package _global_\ntrain:\n  max_steps: 2\n  max_steps: 3\n"},
    ),
    Case(
        "experiment file that includes itself",
        "path",
        ("--config-dir", "{tmp}/conf", "experiment=mine"),
        ("conf/experiment/mine.yaml includes itself in its defaults list (experiment/mine -> experiment/mine)",),
        files={"conf/experiment/mine.yaml": "# @package _global_\ndefaults:\n  - /experiment/mine\n  - _self_\n"},
    ),
    Case(
        "experiment files that include each other",
        "sweep",
        ("-m", "--config-dir", "{tmp}/conf", "experiment=a,b", "hydra.sweep.dir={tmp}/sweep"),
        ("conf/experiment/a.yaml and", "include each other", "experiment/a -> experiment/b -> experiment/a"),
        files={
            "conf/experiment/a.yaml": "# @package _global_\ndefaults:\n  - b\n  - _self_\n",
            "conf/experiment/b.yaml": "# @package _global_\ndefaults:\n  - /experiment/a\n  - _self_\n",
        },
    ),
    Case(
        "experiment file without its package header",
        "path",
        ("--config-dir", "{tmp}/conf", "experiment=bare"),
        ("conf/experiment/bare.yaml: an experiment file sets keys of the whole config", "`# @package _global_`"),
        files={"conf/experiment/bare.yaml": "train:\n  max_steps: 2\n"},
    ),
    Case(
        "experiment_name holding a path",
        "config value",
        ("--config-dir", "{tmp}/conf", "experiment=away"),
        ("experiment_name=../../away is not a plain name", "experiment_name=away"),
        files={"conf/experiment/away.yaml": "# @package _global_\nexperiment_name: ../../away\n"},
    ),
    Case(
        "sweep whose experiment_name holds a path",
        "sweep",
        ("-m", "experiment_name=../elsewhere", "train.max_steps=2"),
        ("experiment_name=../elsewhere is not a plain name", "experiment_name=elsewhere"),
    ),
    Case(
        "hydra.job.chdir with relative paths",
        "combination",
        ("hydra.job.chdir=true", "data=local", "data.sources.0.path=sft.jsonl", "train.max_steps=2"),
        ("hydra.job.chdir=true runs the job inside its run directory", "data.sources[0].path=sft.jsonl", "absolute"),
        files={"sft.jsonl": jsonl(GOOD_ROW)},
    ),
    Case(  # issue 35 §7: it silently started a fresh run in a new directory
        "resume=auto without a run directory",
        "combination",
        ("resume=auto", "train.max_steps=2"),
        (
            "resume=auto continues the run in hydra.run.dir, and none was given",
            "outputs/default/",
            "nothing was started",
            "python -m ds_exp hydra.run.dir=<run dir> resume=auto",
        ),
        run_dir=False,
    ),
    Case(
        "resume=auto in a run directory without its config",
        "path",
        ("resume=auto", "hydra.run.dir={tmp}/run"),
        ("holds a run (metrics.jsonl) but not its saved config (.hydra/config.yaml)", "with the defaults"),
        files={"run/metrics.jsonl": "{}\n"},
    ),
    Case(
        "--write-experiment with a path as experiment_name",
        "config value",
        ("--write-experiment", "{tmp}/exps/mine.yaml", "experiment_name=a/b"),
        ("--write-experiment: experiment_name=a/b is not a plain name", "nothing was written"),
    ),
    Case(
        "--write-experiment from a broken experiment file",
        "path",
        ("--write-experiment", "{tmp}/exps/mine.yaml", "--config-dir", "{tmp}/conf", "experiment=broken"),
        ("conf/experiment/broken.yaml: not valid YAML",),
        files={"conf/experiment/broken.yaml": "# @package _global_\ntrain: [\n"},
    ),
    # --- issue 31 §5/§7/§8: exports that tell the truth (python -m ds_exp.export's and chat's own refusals are in
    # tests/unit/test_use_refusals.py; full disks mid-run in tests/integration/test_faults.py)
    Case(
        "export inside the checkpoints",
        "path",
        ("train.export_dir=checkpoints/hf_model",),
        (
            "train.export_dir=checkpoints/hf_model is inside train.checkpoint_dir=checkpoints",
            "train.export_dir=hf_model",
        ),
    ),
    # --- issue 33: lm-evaluation-harness scores (eval.harness), refused before any model is loaded
    Case(
        "unknown lm-eval task",
        "config value",
        ("eval.harness.tasks=[arc_eazy]",),
        ("eval.harness.tasks: arc_eazy: lm-eval knows no such task or group; did you mean arc_easy", "task YAML"),
    ),
    Case(
        "task YAML lm-eval rejects",
        "path",
        ("eval.harness.tasks=[qa.yaml]",),
        ("eval.harness.tasks: qa.yaml: lm-eval rejects this task YAML", "doc_to_textt", "task_guide"),
        files={"qa.yaml": HARNESS_TASK.replace("doc_to_text:", "doc_to_textt:"), "qa.jsonl": HARNESS_ROWS},
    ),
    Case(
        "task data file missing",
        "path",
        ("eval.harness.tasks=[qa.yaml]",),
        ("eval.harness.tasks: qa.yaml: its data file", "qa.jsonl is missing (dataset_kwargs.data_files)"),
        files={"qa.yaml": HARNESS_TASK},
    ),
    Case(
        "lm-eval task needing the hub",
        "path",
        ("eval.harness.tasks=[arc_easy]",),
        ("arc_easy: its data is the Hugging Face hub dataset allenai/ai2_arc, HF_HUB_OFFLINE", "local files"),
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": "/nonexistent/datasets", "HF_HUB_CACHE": "/nonexistent/hub"},
    ),
    Case(
        "harness every_save without step exports",
        "combination",
        ("eval.harness.tasks=[ds_exp_synthetic]", "eval.harness.every_save=true"),
        ("eval.harness.every_save=true scores the exports of train.export_every, which is 0", "train.export_every=N"),
    ),
    Case(
        "harness tasks without the export",
        "combination",
        ("eval.harness.tasks=[ds_exp_synthetic]", "train.export=false"),
        ("eval.harness.tasks scores the run's final export, which train.export=false leaves out",),
    ),
    Case(
        "optuna objective no task reports",
        "sweep",
        (
            "-m",
            "hydra/sweeper=optuna",
            "optimizer.lr=interval(1e-5,1e-3)",
            "eval.harness.tasks=[ds_exp_synthetic]",
            "hydra.sweeper.objective=harness.ds_exp_synthetic.f1",
        ),
        ("hydra.sweeper.objective=harness.ds_exp_synthetic.f1: the runs' lm-eval scores hold no such number",),
    ),
    # --- issue 39 §4: what lm-eval cannot judge, refused before any model loads (it failed after the training, or
    # was scored silently: "Question: None", a passkey cut off to 0.0); the task, its file and row named
    Case(
        "lm-eval choice longer than the model",
        "data row",
        ("eval.harness.tasks=[qa.yaml]",),
        ("eval.harness.tasks: qa.yaml: row 1 of qa.jsonl: an answer of", "longer than the 512 positions of model tiny"),
        files={
            "qa.yaml": HARNESS_TASK,
            "qa.jsonl": jsonl({"question": "pick", "choices": ["word " * 600, "a"], "answer": 0}),
        },
    ),
    Case(
        "lm-eval group with no tasks",
        "path",
        ("eval.harness.tasks=[group.yaml]",),
        ("eval.harness.tasks: group.yaml: its group mine holds no tasks; name its tasks under `task:`",),
        files={"group.yaml": "group: mine\ntask: []\n"},
    ),
    Case(
        "lm-eval on CUDA on a machine without",
        "combination",
        ("eval.harness.tasks=[ds_exp_synthetic]", "eval.harness.device=cuda"),
        ("eval.harness.device=cuda: this machine has no CUDA device", "use cpu or auto"),
        env={"DS_ACCELERATOR": "cpu"},
    ),
    Case(
        "more few-shot examples than the task has",
        "combination",
        ("eval.harness.tasks=[qa.yaml]", "eval.harness.num_fewshot=100"),
        ("eval.harness.tasks: qa.yaml: eval.harness.num_fewshot=100 few-shot examples, but the task has 20", "give at"),
        files={
            "qa.yaml": HARNESS_TASK,
            "qa.jsonl": jsonl(*[{"question": f"{i}?", "choices": ["a", "b"], "answer": 0} for i in range(20)]),
        },
    ),
    Case(
        "task rows without the field the prompt reads",
        "data row",
        ("eval.harness.tasks=[qa.yaml]",),
        ("eval.harness.tasks: qa.yaml: rows 2, 3 of qa.jsonl (2 of 3 questions) have no field question", "doc_to_text"),
        files={
            "qa.yaml": HARNESS_TASK.replace("doc_to_text: question", 'doc_to_text: "Question: {{question}}\\nAnswer:"'),
            "qa.jsonl": jsonl(
                {"question": "2+2?", "choices": ["4", "5"], "answer": 0},
                *[{"q": "?", "choices": ["a", "b"], "answer": 0}] * 2,
            ),
        },
    ),
    Case(
        "passkey longer than the model",
        "combination",
        ("eval.harness.tasks=[ds_exp_passkey]", "eval.harness.passkey_lengths=[4096]"),
        ("eval.harness.passkey_lengths: ds_exp_passkey's prompts of 4096 tokens are beyond the 512 positions", "give"),
    ),
    Case(
        "task data row not JSON",
        "data row",
        ("eval.harness.tasks=[qa.yaml]",),
        ("eval.harness.tasks: qa.yaml: its data file qa.jsonl cannot be read: line 2 is not valid JSON",),
        files={"qa.yaml": HARNESS_TASK, "qa.jsonl": HARNESS_ROWS + '{"question": "3+3?", "choices": ["6"\n'},
    ),
    # --- issue 31 §2/§9: values the typed schema cannot reach, numbers past 64 bits, shapes, paths, flex attention
    Case(
        "flex attention on a CPU under sequence parallelism",
        "combination",
        ("dist.sequence_parallel_size=2", "model.attn_implementation=flex_attention"),
        ("model.attn_implementation=flex_attention cannot train on the CPU", "model.attn_implementation=sdpa"),
    ),
    Case(
        "scheduler kwarg its schedule does not take",
        "config value",
        ("scheduler=cosine_with_restarts", "+scheduler.kwargs.num_cycle=2"),
        ("scheduler.kwargs.num_cycle=2: scheduler.name=cosine_with_restarts takes no num_cycle", "num_cycles"),
    ),
    Case(
        "scheduler kwarg not a number",
        "config value",
        ("scheduler=cosine_with_restarts", "scheduler.kwargs.num_cycles=abc"),
        ("scheduler.kwargs.num_cycles=abc: give a whole number",),
    ),
    Case(
        "rope scaling field its type does not have",
        "config value",
        ("model.rope_scaling={rope_type:linear,factor:4.0,low_freq_factor:1.0}",),
        ("rope_type=linear has no field low_freq_factor", "remove it"),
    ),
    Case(
        "rope scaling field not a number",
        "config value",
        ("model.rope_scaling={rope_type:yarn,factor:4.0,beta_fast:fast}",),
        ("model.rope_scaling.beta_fast=fast: give a number",),
    ),
    Case(
        "more MLP tiles than tokens",
        "combination",
        ("model.tiled_mlp=true", "model.tiled_mlp_shards=1000", "data.max_seq_len=512"),
        ("model.tiled_mlp_shards=1000 is more than the 512 tokens a rank holds", "give at most 512"),
    ),
    Case(
        "a mapping in a list of numbers",
        "config value",
        ("optimizer.betas=[{a:1},0.95]",),
        ("optimizer.betas=", "item 0 is dict, not number"),
    ),
    Case(
        "a whole number past 64 bits",
        "config value",
        ("train.seed=18446744073709551616",),
        ("train.seed=18446744073709551616: too large", "2^63 - 1"),
    ),
    Case(
        "attention transformers does not have",
        "config value",
        ("model.attn_implementation=flash",),
        ("model.attn_implementation=flash: transformers has no such attention", "sdpa"),
    ),
    Case(
        "ZeRO bucket size not a number",
        "config value",
        ("zero.reduce_bucket_size=lots",),
        ("zero.reduce_bucket_size=lots: give a whole number >= 0", "or auto"),
    ),
    Case("resume from a device", "path", ("resume=/dev/null",), ("resume=/dev/null is not a directory",)),
    Case(
        "tokenizer a device",
        "path",
        ("model.tokenizer=/dev/zero",),
        ("model.tokenizer=/dev/zero is not a directory", "tokenizer (or model) directory"),
    ),
    Case(
        "data cache a link planted in a shared directory",
        "path",
        ("data.cache_dir={tmp}/planted",),
        ("data.cache_dir=", "planted is a symbolic link", "does not follow links"),
        links={"planted": "{tmp}"},
    ),
    Case(
        "a path name longer than a file system allows",
        "path",
        (f"data.cache_dir={{tmp}}/{'n' * 300}",),
        ("data.cache_dir: the name nnnn", "more than file systems allow (255)", "give a shorter name"),
    ),
]


# Cases the training stack refuses (the batch and the plan, the backend, the model's code, what only the run knows):
# a process of their own. The rest are refused before any heavy work and run through the CLI's main() in-process.
REFUSED_BY_THE_RUN = frozenset(
    {
        "LoRA target matches no layer",
        "resume from a run without checkpoints",
        "resume from an incomplete checkpoint",
        "fewer rows than one batch",
        "max_seq_len too short",
        "nccl without GPUs",
        "mpi backend missing from torch",
        "export_dir onto a directory that is not an export",
        "misspelt key in a DeepSpeed JSON block",
        "warmup longer than the run",
        "unknown model_type",
        "checkpoint with its own code",
        "generation past learned positions",
    }
)
# Refused before heavy work, and run as a process too: the real path (python -m ds_exp) gives the same message
REAL_PATH = frozenset({"unknown option", "data file missing", "optuna search over a key a DeepSpeed JSON sets"})


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    tmp: Path

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def prepare(case: Case, tmp: Path) -> tuple[list[str], dict[str, str]]:
    """Write the case's files and links into `tmp`; return its command line and its environment variables."""
    for name, content in case.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    for name, target in case.links.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).symlink_to(target.replace("{tmp}", str(tmp)))
    for name in case.fifos:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(tmp / name)
    args = [a.replace("{tmp}", str(tmp)) for a in case.args]
    if case.run_dir and not any(a.startswith(("hydra.run.dir=", "-m")) for a in args):
        args.append(f"hydra.run.dir={tmp}/run")
    if not any(a.startswith("data.cache_dir=") for a in args):  # a case that gives its own keeps it
        args.append(f"data.cache_dir={tmp}/cache")
    return args, {**case.env, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def run_case(case: Case, tmp: Path) -> Outcome:
    """`python -m ds_exp ARGS` in `tmp` (outputs land there) after writing the case's files: the real path, a
    process of its own: a fresh interpreter for the REAL_PATH cases, which prove the whole path; forked from the
    test zygote for the others (tests/zygote.py)."""
    args, env = prepare(case, tmp)
    argv, full_env = ["-m", "ds_exp", *args], {**user_env(), **env}
    proc = run_python(argv, cwd=tmp, env=full_env, timeout=300, fresh=case.id in REAL_PATH)
    return Outcome(proc.returncode, proc.stdout, proc.stderr, tmp)


class ReachedHeavyWork(BaseException):
    """A case run in this process got past every check to the training stack or the dry run. Not an Exception:
    Hydra's launcher records an Exception as its job's failure and composes the next job, while a sweep's jobs
    were all composed and checked by its sweeper before the first launched; the first job that gets this far ends
    the case (the README's autotune line: one probe launched here, not 56)."""


def run_case_in_process(case: Case, tmp: Path) -> Outcome:
    """The same command through the CLI's own main() in this process, for cases refused before any heavy work: the
    same message and exit status without a process start (~2 s each). The training stack and the dry run are
    replaced by a tripwire, so a case that gets past the checks fails loudly instead of training here."""
    from hydra.core.global_hydra import GlobalHydra

    from ds_exp.launch import cli, lock
    from ds_exp.sweeps import jobs

    args, env = prepare(case, tmp)
    saved_env, saved_argv, saved_cwd = dict(os.environ), list(sys.argv), os.getcwd()
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    out, err = io.StringIO(), io.StringIO()
    code: int
    try:
        for name in LAUNCH_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(env)
        os.chdir(tmp)
        sys.argv = ["ds_exp", *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _tripwire(cli):
            try:
                cli.main()
                code = 0
            except SystemExit as exited:
                if isinstance(exited.code, str):  # sys.exit("message"): the interpreter would print it
                    print(exited.code, file=sys.stderr)
                code = exited.code if isinstance(exited.code, int) else (0 if exited.code is None else 1)
            except ReachedHeavyWork as reached:  # as an uncaught exception would end the process
                print(f"{type(reached).__name__}: {reached}", file=sys.stderr)
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        GlobalHydra.instance().clear()
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        logging.captureWarnings(False)
        for held in list(lock._locks):
            lock.release_run_dir(held)
        for held in list(lock._sweep_locks):
            lock.release_sweep_dir(held)
        jobs.launched_job_dirs.clear()  # a sweep run here: the next sweep report of this process is not its
    return Outcome(code, out.getvalue(), err.getvalue(), tmp)


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


TRIPPED: list[Any] = []  # each job that reached the tripwire (a sweep's jobs report their failures elsewhere)


HEAVY_ENTRIES = (("ds_exp.train.recipe", "recipe_main"), ("ds_exp.tools.dry_run", "dry_run"))


@contextlib.contextmanager
def _tripwire(cli: Any) -> Iterator[None]:
    """cli.run_job's heavy branches (the recipe, the dry run) raise ReachedHeavyWork while the case runs. A module
    not imported yet is stood in for by an empty one for the while (cli._run_job imports it where it calls it): a
    case refused before heavy work costs no import of torch, DeepSpeed and transformers (~10 s a process)."""
    original = cli.run_job

    def checked(composed: Any) -> Any:
        def tripped(*args: Any, **kwargs: Any) -> Any:
            TRIPPED.append(composed)
            raise ReachedHeavyWork("the case passed every check and reached the training stack")

        stand_ins = [name for name, _ in HEAVY_ENTRIES if name not in sys.modules]
        for name in stand_ins:
            sys.modules[name] = types.ModuleType(name)
        saved = {(name, attr): getattr(sys.modules[name], attr, None) for name, attr in HEAVY_ENTRIES}
        for name, attr in HEAVY_ENTRIES:
            setattr(sys.modules[name], attr, tripped)
        try:
            return original(composed)
        finally:
            for (name, attr), value in saved.items():
                setattr(sys.modules[name], attr, value)
            for name in stand_ins:
                del sys.modules[name]

    cli.run_job = checked
    try:
        yield
    finally:
        cli.run_job = original


def message_of(outcome: Outcome) -> str:
    """The message a person reads: ds_exp's error lines, or Hydra's when composition failed."""
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.startswith("ds_exp: error")), 0)
    kept = [line for line in lines[start:] if "HYDRA_FULL_ERROR" not in line]
    return "\n".join(kept)


def write_docs(path: Path) -> None:
    import tempfile

    rows = []
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            outcome = run_case(case, Path(tmp))
        message = message_of(outcome).replace(str(tmp), "<tmp>").replace("|", "\\|").replace("\n", "<br>")
        command = " ".join(a.replace("{tmp}", "<tmp>") for a in case.args)
        rows.append(f"| {case.kind} | {case.id} | `{command}` | {outcome.returncode} | {message} |")
    header = [
        "# Bad inputs and what ds_exp says",
        "",
        "Every row is a case of `tests/bad_inputs.py`, run by `tests/unit/test_bad_inputs.py`: the command after",
        "`python -m ds_exp` (`<tmp>` holds the files the case writes), the exit status and the message printed.",
        "Each exits non-zero, prints no traceback (`HYDRA_FULL_ERROR=1` shows it) and leaves nothing that looks",
        "like a finished run. Regenerate with `python -m tests.bad_inputs`.",
        "",
        "| kind | case | command | exit | message |",
        "|---|---|---|---|---|",
    ]
    # what follows the table was written by hand (the sections from its first `## ` on): kept as it is
    kept = path.read_text().partition("\n## ") if path.is_file() else ("", "", "")
    tail = f"\n## {kept[2]}" if kept[1] else ""
    path.write_text("\n".join(header + rows) + "\n" + tail)


if __name__ == "__main__":
    write_docs(REPO / "docs" / "bad_inputs.md")
    print(f"wrote {REPO / 'docs' / 'bad_inputs.md'} ({len(CASES)} cases)")
