"""Every `python -m ds_exp` and launcher command the README shows composes and passes every check.

Each command runs through the CLI's own main() in this process, in one scratch directory holding the files the
README's commands name (data/sft.jsonl, ...), with the training stack replaced by a tripwire
(tests/bad_inputs.py): a command passes when it reaches training or the dry run, or ends by itself with status 0
(--write-experiment, --help). What is not checked here: the SLURM and submitit launchers' own keys (their
commands run with Hydra's basic launcher instead; the SLURM tests run those launchers), and commands with a
placeholder (`...`, `<date_time>`, `/path/to/checkpoint`). The commands on the real SmolLM2-135M checkpoint (its
directory under `$HOME`) are checked against the tests' own copy of it, on the long rows the README's script makes.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from tests.bad_inputs import TRIPPED, Case, jsonl, run_case_in_process
from tests.training import REPO

README = REPO / "README.md"
PLACEHOLDERS = ("...", "<", "/path/to/", "$HOME")
REAL_MODEL = "$HOME/.cache/ds_exp/test_models/smollm2-135m-instruct-v1-tf5"  # what `python -m tests.real_model` builds
# a command that is refused on purpose here: its fragment of the message, and why
REFUSED_HERE = {
    "resume=outputs/long/checkpoints/step400": "no such checkpoint: the run before it trained nothing here",
    "model.name_or_path=outputs/sft/hf_model": "no such model: the SFT run before it trained nothing here",
}

CHAT_ROW = {"messages": [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5."}]}
FILES: dict[str, str | bytes] = {
    "data/sft.jsonl": jsonl(*[CHAT_ROW] * 40),
    "data/a.jsonl": jsonl(*[CHAT_ROW] * 40),
    "data/b.csv": "q,chosen\n" + "".join(f"What is {i} plus 1?,{i + 1}.\n" for i in range(40)),
    "data/train.json": json.dumps([{"prompt": " Human: Hi? Assistant:", "chosen": " Hello.", "rejected": " Go."}] * 40),
    "data/eval.json": json.dumps([{"prompt": " Human: Hi? Assistant:", "chosen": " Hello.", "rejected": " Go."}] * 8),
}
# how many ranks each launcher line starts (the in-process run sees them as an env launch of that world size)
RANKS = [
    re.compile(r"^launchers/(?:torchrun|deepspeed|mpirun)\.sh (\d+) (.*)$"),
    re.compile(r"^(?:python -m ds_exp.tools.)?torchrun --nproc_per_node (\d+) -m ds_exp(.*)$"),
    re.compile(r"^deepspeed --num_gpus (\d+) --module ds_exp(.*)$"),
    re.compile(r"^mpirun -np (\d+) .*?python -m ds_exp(.*)$"),
]


def readme_commands(model_dir: Path | None = None) -> list[tuple[str, int, list[str]]]:
    """(the line as shown, ranks, arguments) for each ds_exp command in the README's code blocks, in order; with
    `model_dir`, only those on the real SmolLM2 checkpoint, its directory replaced by `model_dir`."""
    return [command for block in readme_blocks(model_dir) for command in block]


def readme_blocks(model_dir: Path | None = None) -> list[list[tuple[str, int, list[str]]]]:
    """readme_commands by code block: a block's commands run in order (one writes a file the next reads)."""
    blocks = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", README.read_text(), flags=re.S | re.M):
        commands = []
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if model_dir is not None:
                if REAL_MODEL not in line:
                    continue
                line = line.replace(REAL_MODEL, str(model_dir))
            ranks, rest = 1, None
            if line == "python -m ds_exp" or line.startswith("python -m ds_exp "):
                rest = line[len("python -m ds_exp") :]
            for pattern in RANKS:
                match = pattern.match(line)
                if match:
                    ranks, rest = int(match.group(1)), match.group(2)
            if rest is None:
                continue
            args = shlex.split(rest, comments=True)
            if any(p in arg for arg in args for p in PLACEHOLDERS):
                continue
            commands.append((line, ranks, args))
        if commands:
            blocks.append(commands)
    return blocks


def test_the_readme_shows_commands_of_every_kind():
    shown = readme_commands()
    assert len(shown) >= 25, shown
    assert any(ranks > 1 for _, ranks, _ in shown) and any("-m" in args for _, _, args in shown)


# one test per code block, so that pytest's workers share them (the autotune line alone takes a minute)
@pytest.mark.parametrize("block", range(len(readme_blocks())), ids=lambda n: readme_blocks()[n][0][0][:60])
def test_every_readme_command_passes_every_check(tmp_path, block):
    assert not check_commands(readme_blocks()[block], tmp_path, FILES)


def check_commands(commands: list[tuple[str, int, list[str]]], tmp_path: Path, files: dict[str, str | bytes]) -> str:
    """Each command through the CLI's main() in this process: what failed, one paragraph per command."""
    failed = []
    for num, (line, ranks, args) in enumerate(commands):
        # the SLURM and submitit launchers are replaced by Hydra's basic one (nothing is submitted from a test)
        args = [a for a in args if not a.startswith(("hydra/launcher=", "hydra.launcher."))]
        if "-m" in args and not any(a.startswith("hydra.sweep.dir=") for a in args):
            args.append(f"hydra.sweep.dir={{tmp}}/sweeps/{num}")
        if "-m" not in args and not any(a.startswith(("hydra.run.dir=", "--")) for a in args):
            args.append(f"hydra.run.dir={{tmp}}/runs/{num}")
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1"}
        # wandb offline (an online run asks wandb's server before it starts): tests talk to no server but 127.0.0.1
        env = {**(env if ranks > 1 else {}), "WANDB_MODE": "offline"}
        reached_before = len(TRIPPED)
        outcome = run_case_in_process(Case(line, "readme", tuple(args), (), files=files, env=env), tmp_path)
        reason = next((why for fragment, why in REFUSED_HERE.items() if fragment in line), None)
        if reason is not None:
            assert outcome.returncode != 0, f"{line}: expected to be refused here ({reason})"
            continue
        if len(TRIPPED) > reached_before or (outcome.returncode == 0 and "error" not in outcome.stderr):
            continue
        failed.append(f"{line}\n  -> status {outcome.returncode}: {outcome.output[-1500:]}")
    return "\n".join(failed)


@pytest.mark.slow
def test_the_long_context_commands_pass_every_check_on_rows_that_fill_smollm2s_context(tmp_path, smollm2_dir):
    """The README's long-context how-to: its script writes the pass-key rows, each long enough to mean something at
    data.max_seq_len=8192 (past 6,000 tokens in SmolLM2's chat template, not cut), and every command on the real
    checkpoint (one rank, N=3 over 3 ranks, the DeepSpeed-Chat run) composes and passes the model's checks."""
    from transformers import AutoTokenizer

    heredoc = r"^mkdir -p data && python - > data/passkey.jsonl <<'EOF'\n(.*?)^EOF$"
    script = re.search(heredoc, README.read_text(), flags=re.S | re.M)
    assert script, "README.md's long-context how-to no longer writes data/passkey.jsonl"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(script[1], {})  # the README's own script, as a user runs it
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(rows) == 200 and len({row["chosen"] for row in rows}) > 150
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    conversation = [{"role": "user", "content": rows[0]["prompt"]}, {"role": "assistant", "content": rows[0]["chosen"]}]
    tokens = len(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"])
    assert 6000 < tokens <= 8192, tokens
    commands = readme_commands(smollm2_dir)
    assert any("dist.sequence_parallel_size=3" in line for line, _, _ in commands), commands
    assert sum("data/passkey.jsonl" in line for line, _, _ in commands) == 2, commands
    files: dict[str, str | bytes] = {**FILES, "data/passkey.jsonl": "\n".join(json.dumps(r) for r in rows[:8]) + "\n"}
    assert not check_commands(commands, tmp_path, files)


def test_every_file_and_section_the_readme_links_to_exists():
    text = README.read_text()
    anchors = {
        re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)
    }
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if (path and not (REPO / path).exists()) or (not path and anchor not in anchors):
            missing.append(target)
    assert not missing, missing
