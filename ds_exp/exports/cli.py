"""`python -m ds_exp.export` and `python -m ds_exp.chat`: what they can refuse without torch is refused here; the
work (writer.py, chat.py) is imported after, and refuses what only torch can tell (a missing device, bad weights)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ds_exp.config.fields import MAX_TOKENS
from ds_exp.config.sampling import sampling_problems
from ds_exp.config.schema import plain
from ds_exp.core import compat
from ds_exp.core.errors import ConfigError, RunFailed
from ds_exp.exports.checks import (
    check_outside_checkpoints,
    check_target,
    context_of,
    find_checkpoint,
    model_dir_of,
    model_settings_of,
    refuse_reward_model,
    run_dir_of,
)
from ds_exp.exports.on_disk import (
    WRITTEN_BY_RUN,
    adapter_dir,
    checkpoint_step,
    default_export_dir,
    read_metadata,
    run_config,
)
from ds_exp.launch.console import entry_point
from ds_exp.launch.flags import SEED, FlagParser, number, path_text, whole
from ds_exp.launch.run_logging import hold_library_logs
from ds_exp.launch.storage import check_writable
from ds_exp.resume.settings import moved_base
from ds_exp.resume.store import read_marker

# devices a model can be moved to for chat: the CPU, CUDA (ROCm too), Apple's MPS, Intel's XPU, with an index
DEVICE = re.compile(r"(cpu|cuda(:\d+)?|mps|xpu(:\d+)?)")

RUN = "outputs/default/2026-01-01_12-00-00"  # a run directory as conf/config.yaml's hydra.run.dir lays it out
RUNS = """A run directory is outputs/<experiment_name>/<date>_<time> (hydra.run.dir; experiment_name is default unless
set); a sweep's jobs are outputs/multirun/<experiment_name>/<date>_<time>/<job number>."""

EXPORT_EPILOG = f"""examples:
  python -m ds_exp.export {RUN}
      the run's newest complete checkpoint -> <run>/hf_model-step<N>
  python -m ds_exp.export {RUN}/checkpoints/step40 /data/m40
      that checkpoint -> /data/m40
  python -m ds_exp.export {RUN} --adapter
      LoRA alone -> <run>/hf_model-step<N>_adapter
{RUNS}
The export is what the run's own export at that step holds: the base model's identity (vocabulary, dtype,
tokenizer, generation config) and ds_exp_export.json saying where it comes from; with LoRA the adapter (DIR_adapter)
and the merged model (DIR) where the run's train.export_merged puts one (end: its last step; every; none), or
where --merged asks for it.
DIR is replaced only when it is an earlier export of ds_exp (never the run's own export of another step)."""

CHAT_EPILOG = f"""examples:
  python -m ds_exp.chat {RUN}/hf_model
      a conversation on a terminal with the run's final export
  python -m ds_exp.chat {RUN}
      the same: a run directory's hf_model
  python -m ds_exp.chat {RUN}/hf_model-step40
      a step export (train.export_every)
  printf 'What is 2+2?\\nName a colour.\\n' | python -m ds_exp.chat {RUN} --temperature 0.7 --seed 1
      one answer per line, sampled
{RUNS}
With standard input not a terminal, every line is one prompt on its own and its answer is printed (one per
prompt; --jsonl prints {{"prompt", "completion"}} lines). A line that is not UTF-8 text is said on stderr with its
number and not answered; the others are, and the exit status is then 1. Prompts are rendered with the template the
run trained with (recorded in the export; rows that carried their own " Human: ... Assistant:" markup: that
markup), else the tokenizer's chat template, else DeepSpeed-Chat's " Human: ... Assistant:". An empty answer gets
a hint on stderr. A prompt (or a conversation) longer than the model's positions less --max-new-tokens is cut from
the left, said on stderr: its oldest tokens go."""


def export_parser() -> argparse.ArgumentParser:
    p = FlagParser(
        prog="python -m ds_exp.export",
        description="Export a checkpoint (any ZeRO stage, with or without LoRA) to Hugging Face format.",
        epilog=EXPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "checkpoint",
        type=path_text,
        help="a run directory (its newest complete checkpoint), its checkpoints directory, or one step<N> checkpoint",
    )
    p.add_argument(
        "dir", nargs="?", type=path_text, help="where the export goes (default <run dir>/<train.export_dir>-step<N>)"
    )
    lora = p.add_mutually_exclusive_group()
    lora.add_argument("--adapter", action="store_true", help="with LoRA: the PEFT adapter alone in DIR")
    lora.add_argument(
        "--merged", action="store_true", help="with LoRA: the merged model too, whatever the run's train.export_merged"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="the weights' dtype (default: the run's train.export_dtype; auto = the base checkpoint's)",
    )
    p.add_argument("--base", type=path_text, help="where the run's base model (model.name_or_path) is now, if moved")
    return p


def chat_parser() -> argparse.ArgumentParser:
    p = FlagParser(
        prog="python -m ds_exp.chat",
        description="Talk to an exported model: a conversation on a terminal, one answer per line of standard input.",
        epilog=CHAT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "dir", type=path_text, help="a Hugging Face model directory (an export), or a run directory (its hf_model)"
    )
    # the types refuse nan, inf and numbers past 64 bits at once; the ranges are checked below, as eval.* are
    p.add_argument("--temperature", type=number(), default=0.0, help="0 = greedy (default); > 0 samples, e.g. 0.7")
    p.add_argument("--top-p", type=number(), default=1.0, help="with sampling: nucleus probability; 1 = off (default)")
    p.add_argument("--top-k", type=whole(), default=0, help="with sampling: the k likeliest tokens; 0 = off (default)")
    p.add_argument(
        "--max-new-tokens", type=whole(high=MAX_TOKENS), default=256, help="tokens generated per answer (default 256)"
    )
    p.add_argument("--seed", type=SEED, help="seeds the sampling once, at the start, 0 to 2^32 - 1 (default: unseeded)")
    p.add_argument(
        "--template",
        choices=["auto", "chat_template", "dschat", "raw"],
        default="auto",
        help="how prompts are rendered (default auto: the run's, see below)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when there is one)")
    p.add_argument("--jsonl", action="store_true", help="standard input mode: print JSON lines {prompt, completion}")
    return p


@entry_point("ds_exp.export")
def export_main(argv: list[str] | None = None) -> int:
    hold_library_logs()  # what DeepSpeed and transformers say on import stays off the console
    args = export_parser().parse_args(sys.argv[1:] if argv is None else argv)
    tag_dir = find_checkpoint(args.checkpoint)
    run_dir = run_dir_of(tag_dir)
    cfg = run_config(run_dir, tag_dir)  # with the model section the checkpoint was trained with
    cfg.model = moved_base(cfg.model, args.base)
    step, marker = checkpoint_step(tag_dir), read_marker(tag_dir)
    settings = marker.get("settings") or {}
    lora = settings.get("lora") if "lora" in settings else (cfg.lora.dim > 0 or None)
    if args.adapter and not lora:
        raise ConfigError(
            f"--adapter: {tag_dir} holds no LoRA adapters (the run trained with lora.dim=0): export the whole model "
            "without --adapter"
        )
    # what the run's own export at that step holds: with LoRA the adapter beside, and the merged model where its
    # train.export_merged puts one (the run's final step is its final export), or where --merged asks for it
    final = step >= int((marker.get("trajectory") or {}).get("total_steps") or step)
    merged = args.merged or cfg.train.merges(cfg.lora.dim if lora else 0, final=final)
    default = default_export_dir(run_dir / cfg.train.export_dir, tag_dir, step)
    target = Path(args.dir).expanduser() if args.dir else adapter_dir(default) if args.adapter else default
    written = [target] if args.adapter or not lora else [target, adapter_dir(target)][0 if merged else 1 :]
    check_outside_checkpoints(target, run_dir / cfg.train.checkpoint_dir, "DIR")
    check_writable(target.parent, "DIR")
    for path in written:
        try:
            check_target(path, key="DIR", fix="move it away or give another DIR", adapter=False)
        except RunFailed as err:  # refused before anything is done: a usage error
            raise ConfigError(str(err)) from None
        origin = read_metadata(path).get("origin") or {}
        if origin.get("written_by") == WRITTEN_BY_RUN and origin.get("step") != step:
            raise ConfigError(
                f"DIR: {path} is the run's own export of step {origin.get('step')}, so it is not replaced by step "
                f"{step}; give another DIR"
            )
    stage, world = settings.get("zero_stage", "?"), settings.get("world_size", "?")
    what = "the LoRA adapter of " if written[0] != target or args.adapter else ""
    ranks = f"{world} rank{'' if world == 1 else 's'}"
    shown = " and ".join(str(path) for path in written)
    print(f"ds_exp: exporting {what}{tag_dir} (step {step}, ZeRO-{stage}, {ranks}) to {shown}", file=sys.stderr)
    compat.import_deepspeed_without_mlflow()  # DeepSpeed would import all of mlflow (the extra) for nothing
    from ds_exp.exports.writer import export_checkpoint

    export_checkpoint(
        tag_dir, run_dir, cfg, target, dtype=args.dtype, adapter=args.adapter, save_adapter=True, merged=merged
    )
    metadata = read_metadata(written[0])
    how = f"{metadata.get('dtype')}: {metadata.get('why')}" if what == "" else "float32, PEFT's files, as trained"
    if not (merged or args.adapter):
        how += (
            f"; no merged model at step {step} (train.export_merged={plain(cfg.train.export_merged)}): --merged adds it"
        )
    print(f"ds_exp: exported step {step} to {shown} ({how})")
    return 0


@entry_point("ds_exp.chat")
def chat_main(argv: list[str] | None = None) -> int:
    hold_library_logs()  # what DeepSpeed and transformers say on import stays off the console
    args = chat_parser().parse_args(sys.argv[1:] if argv is None else argv)
    names = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k"}
    problems = sampling_problems(args.temperature, args.top_p, args.top_k, key=names.__getitem__)
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    if args.device != "auto" and not DEVICE.fullmatch(args.device):
        problems.append(
            f"--device={args.device}: not a device; give cpu, cuda, cuda:N (the GPU's index), mps or xpu[:N], or "
            "auto (cuda when there is one, else cpu)"
        )
    if problems:
        raise ConfigError(problems)
    model_dir = model_dir_of(args.dir)
    refuse_reward_model(model_dir, "there is nothing to chat with")
    context = context_of(model_settings_of(model_dir, str(model_dir)))
    if context is not None and args.max_new_tokens >= context[0]:
        raise ConfigError(
            f"--max-new-tokens={args.max_new_tokens} leaves no room for a prompt within the model's {context[1]}: "
            f"give --max-new-tokens below {context[0]}, e.g. {min(256, context[0] // 2)}"
        )
    compat.import_deepspeed_without_mlflow()
    from ds_exp.exports.chat import chat

    return chat(model_dir, args, context=context[0] if context else None)
