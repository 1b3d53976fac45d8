"""`python -m ds_exp.evaluate TARGET TASK [TASK ...]`: every refusal first (plan.py), before torch; the work
(harness.run) after."""

from __future__ import annotations

import argparse
import sys

from ds_exp.evaluation.plan import make_plan
from ds_exp.launch.console import entry_point
from ds_exp.launch.flags import FlagParser, number, path_text, whole
from ds_exp.launch.run_logging import hold_library_logs

EPILOG = """examples:
  python -m ds_exp.evaluate outputs/default/<date_time> ds_exp_synthetic     the run's base and final export
  python -m ds_exp.evaluate outputs/.../hf_model-step40 my_tasks/qa.yaml     one export (RUN_DIR/eval/hf_model-step40)
  python -m ds_exp.evaluate outputs/.../checkpoints/step40 arc_easy --limit 100   exported first, then scored
TASK: an lm-evaluation-harness task or group name, a task YAML file (lm-eval's format, its data in local files:
dataset_path: json with dataset_kwargs.data_files), or a built-in: ds_exp_synthetic (multiple choice drawn from the
embedded task), ds_exp_passkey (a passkey in filler text, --passkey-lengths). Prompts are rendered in the run's
template (--no-template: lm-eval's raw prompts). The base model's scores are cached under the run's data.cache_dir.
Written: RUN_DIR/eval/harness.json (base, tuned, stderr per task and metric), harness.png, lm-eval's samples."""


def parser() -> argparse.ArgumentParser:
    p = FlagParser(
        prog="python -m ds_exp.evaluate",
        description="Did the fine-tune help? lm-eval scores of a run's export beside its base model's.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "target",
        type=path_text,
        help="a run directory (base vs final export), an export or model directory, a checkpoint",
    )
    p.add_argument("tasks", nargs="+", metavar="TASK", help="lm-eval task or group names, task YAML files, built-ins")
    p.add_argument(
        "--limit", type=number(), help="questions per task (a fraction when < 1); default: the run's, or all"
    )
    p.add_argument("--num-fewshot", type=whole(0), help="few-shot examples (default: the run's, or each task's own)")
    p.add_argument("--batch-size", type=whole(1), help="lm-eval's batch size (default: the run's eval.harness, or 8)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N (default auto: cuda when there is one)")
    p.add_argument("--no-template", action="store_true", help="lm-eval's raw prompts, not the run's template")
    p.add_argument("--no-base", action="store_true", help="a run directory: its final export alone")
    p.add_argument("--passkey-lengths", help="ds_exp_passkey's lengths in tokens, e.g. 256,1024 (default max_seq_len)")
    p.add_argument(
        "--output", type=path_text, help="where the scores go (default RUN_DIR/eval, or RUN_DIR/eval/<export>)"
    )
    p.add_argument("--base", type=path_text, help="where the run's base model (model.name_or_path) is now, if moved")
    return p


@entry_point("ds_exp.evaluate")
def main(argv: list[str] | None = None) -> int:
    hold_library_logs()  # what libraries say on import stays off the console
    plan = make_plan(parser().parse_args(sys.argv[1:] if argv is None else argv))
    from ds_exp.evaluation.harness import run  # torch, transformers, lm-eval: past every refusal

    return run(plan)
