"""Every `python -m ds_exp` and launcher command the README shows composes and passes every check.

Each command runs through the CLI's own main() in this process, in one scratch directory holding the files the
README's commands name (data/sft.jsonl, ...), with the training stack replaced by a tripwire
(tests/bad_inputs.py): a command passes when it reaches training or the dry run, or ends by itself with status 0
(--write-experiment, --help). What is not checked here: the SLURM and submitit launchers' own keys (their
commands run with Hydra's basic launcher instead; the SLURM tests run those launchers), and commands with a
placeholder (`...`, `<date_time>`, `/path/to/checkpoint`).
"""

from __future__ import annotations

import json
import re
import shlex

from tests.bad_inputs import TRIPPED, Case, jsonl, run_case_in_process
from tests.training import REPO

README = REPO / "README.md"
PLACEHOLDERS = ("...", "<", "/path/to/", "$HOME")
# a command that is refused on purpose here: its fragment of the message, and why
REFUSED_HERE = {
    "resume=outputs/long/checkpoints/step400": "no such checkpoint: the run before it trained nothing here",
}

CHAT_ROW = {"messages": [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5."}]}
FILES: dict[str, str | bytes] = {
    "data/sft.jsonl": jsonl(*[CHAT_ROW] * 40),
    "data/a.jsonl": jsonl(*[CHAT_ROW] * 40),
    "data/b.csv": "q,chosen\n" + "".join(f"What is {i} plus 1?,{i + 1}.\n" for i in range(40)),
    "data/train.json": json.dumps([{"prompt": " Human: Hi? Assistant:", "chosen": " Hello."}] * 40),
    "data/eval.json": json.dumps([{"prompt": " Human: Hi? Assistant:", "chosen": " Hello."}] * 8),
}
# how many ranks each launcher line starts (the in-process run sees them as an env launch of that world size)
RANKS = [
    re.compile(r"^launchers/(?:torchrun|deepspeed|mpirun)\.sh (\d+) (.*)$"),
    re.compile(r"^torchrun --nproc_per_node (\d+) -m ds_exp(.*)$"),
    re.compile(r"^deepspeed --num_gpus (\d+) --module ds_exp(.*)$"),
    re.compile(r"^mpirun -np (\d+) .*?python -m ds_exp(.*)$"),
]


def readme_commands() -> list[tuple[str, int, list[str]]]:
    """(the line as shown, ranks, arguments) for each ds_exp command in the README's code blocks, in order."""
    commands = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", README.read_text(), flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
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
    return commands


def test_the_readme_shows_commands_of_every_kind():
    shown = readme_commands()
    assert len(shown) >= 25, shown
    assert any(ranks > 1 for _, ranks, _ in shown) and any("-m" in args for _, _, args in shown)


def test_every_readme_command_passes_every_check(tmp_path):
    failed = []
    for num, (line, ranks, args) in enumerate(readme_commands()):
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
        outcome = run_case_in_process(Case(line, "readme", tuple(args), (), files=FILES, env=env), tmp_path)
        reason = next((why for fragment, why in REFUSED_HERE.items() if fragment in line), None)
        if reason is not None:
            assert outcome.returncode != 0, f"{line}: expected to be refused here ({reason})"
            continue
        if len(TRIPPED) > reached_before or (outcome.returncode == 0 and "error" not in outcome.stderr):
            continue
        failed.append(f"{line}\n  -> status {outcome.returncode}: {outcome.output[-1500:]}")
    assert not failed, "\n".join(failed)


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
