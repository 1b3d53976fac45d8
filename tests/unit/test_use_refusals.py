"""What `python -m ds_exp.export` and `python -m ds_exp.chat` refuse: one message naming what is wrong and the fix, a
non-zero exit, no traceback, nothing written, and all of it before torch is imported (docs/bad_inputs.md, "Export
and chat"). The run directories here are made by hand: nothing is read past the refusal."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ds_exp.config.paths import conf_dir
from tests.training import user_env


@functools.cache
def composed_yaml() -> str:
    """What a run with the defaults saves as .hydra/config.yaml."""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return OmegaConf.to_yaml(compose(config_name="config"))


def make_run(root: Path) -> Path:
    """A run directory as a run leaves it, to the extent the refusals look: its composed config, a complete
    checkpoint at step 2 (its marker), and an incomplete one at step 3 (files, no marker)."""
    run = root / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(composed_yaml())
    for step in (2, 3):
        (run / "checkpoints" / f"step{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"")
    marker = {"step": 2, "settings": {"lora": None, "zero_stage": 0, "world_size": 1, "precision": "fp32"}}
    (run / "checkpoints" / "step2" / "ds_exp_complete.json").write_text(json.dumps(marker))
    return run


def own_export(run: Path, step: int) -> None:
    (run / "hf_model").mkdir()
    origin = {"written_by": "run", "run_id": "r", "step": step}
    (run / "hf_model" / "ds_exp_export.json").write_text(json.dumps({"origin": origin}))


def orphan(root: Path) -> None:
    (root / "loose" / "step1").mkdir(parents=True)
    (root / "loose" / "step1" / "ds_exp_complete.json").write_text(json.dumps({"step": 1}))


def somebodys(root: Path) -> None:
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("keep me")


def adapter(root: Path) -> None:
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_config.json").write_text("{}")


def model(root: Path, config: dict | None = None, weights: bool = True) -> None:
    """A model directory as far as chat looks before loading it: config.json and a complete (empty) weights file."""
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(config or {"model_type": "llama", "hidden_size": 64}))
    if weights:
        (root / "model" / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")


def base_gone(root: Path) -> None:
    """The run trained from a local base model that is not where it was."""
    config = root / "run" / ".hydra" / "config.yaml"
    saved = OmegaConf.load(config)
    saved.model.name_or_path = str(root / "base")
    OmegaConf.save(saved, config)


@dataclass(frozen=True)
class Case:
    id: str
    tool: str  # export | chat
    args: tuple[str, ...]  # {tmp} is the case's directory, {run} its run directory
    expect: tuple[str, ...]
    setup: Callable[[Path], None] | None = None


CASES = [
    Case("no such checkpoint", "export", ("{tmp}/nope",), ("{tmp}/nope: no such directory", "step<N>")),
    Case(
        "incomplete checkpoint",
        "export",
        ("{run}/checkpoints/step3",),
        ("is an incomplete checkpoint", "ds_exp_complete.json", "the newest complete one is {run}/checkpoints/step2"),
    ),
    Case(
        "a directory without checkpoints",
        "export",
        ("{run}/.hydra",),
        ("no complete checkpoint there", "give a run directory, its checkpoints directory or a step<N>"),
    ),
    Case("a checkpoint without its run", "export", ("{tmp}/loose/step1",), ("no run directory above it",), orphan),
    Case(
        "a target that is not an export",
        "export",
        ("{run}", "{tmp}/mine"),
        ("DIR: {tmp}/mine exists and is not an export of a ds_exp run", "give another DIR"),
        somebodys,
    ),
    Case(
        "the run's export of another step",
        "export",
        ("{run}/checkpoints/step2", "{run}/hf_model"),
        ("{run}/hf_model is the run's own export of step 4", "give another DIR"),
        lambda tmp: own_export(tmp / "run", 4),
    ),
    Case("--adapter without LoRA", "export", ("{run}", "--adapter"), ("--adapter:", "lora.dim=0", "without --adapter")),
    Case(
        "a base model directory that is gone",
        "export",
        ("{run}",),
        ("the base model directory is gone: {tmp}/base (the run's model.name_or_path)", "give --base DIR"),
        base_gone,
    ),
    Case(
        "--base without a model",
        "export",
        ("{run}", "--base", "{tmp}/mine"),
        ("--base={tmp}/mine: no config.json there; give the directory {tmp}/base moved to",),
        lambda tmp: (base_gone(tmp), somebodys(tmp)),
    ),
    Case("chat with no model", "chat", ("{tmp}",), ("not a Hugging Face model directory", "{tmp}: ")),
    Case("chat with an adapter", "chat", ("{tmp}/adapter",), ("is a LoRA adapter", "merged export"), adapter),
    Case("chat with a run not exported", "chat", ("{run}",), ("without an export", "python -m ds_exp.export {run}")),
    Case("negative temperature", "chat", ("{run}", "--temperature", "-1"), ("--temperature=-1.0: must be >= 0",)),
    Case(
        "top-p while greedy",
        "chat",
        ("{run}", "--top-p", "0.9"),
        ("--top-p=0.9 has no effect with --temperature=0", "--temperature > 0"),
    ),
    Case("top-k negative", "chat", ("{run}", "--temperature", "1", "--top-k", "-2"), ("--top-k=-2: must be >= 0",)),
    Case("no new tokens", "chat", ("{run}", "--max-new-tokens", "0"), ("--max-new-tokens=0: must be >= 1",)),
    # --- issue 31 §5/§7: exports that tell the truth, chat's inputs
    Case(
        "an export inside the checkpoints",
        "export",
        ("{run}/checkpoints/step2", "{run}/checkpoints/m2"),
        ("DIR: {run}/checkpoints/m2 is inside the checkpoint directory {run}/checkpoints", "outside it"),
    ),
    Case(
        "a negative seed",
        "chat",
        ("{run}", "--temperature", "1", "--seed", "-1"),
        ("argument --seed: -1 must be from 0 to 4294967295",),
    ),
    Case(
        "a seed past 2**32 - 1",
        "chat",
        ("{run}", "--seed", "4294967296"),
        ("argument --seed: 4294967296 must be from 0 to 4294967295",),
    ),
    Case("not a device", "chat", ("{run}", "--device", "banana"), ("--device=banana: not a device", "cuda:N")),
    Case(
        "a device this machine lacks",
        "chat",
        ("{tmp}/model", "--device", "cuda:3"),
        ("--device=cuda:3: this machine has no cuda device", "--device cpu"),
        model,
    ),
    Case(
        "a model without weights",
        "chat",
        ("{tmp}/model",),
        ("{tmp}/model: no weights in it (model.safetensors", "python -m ds_exp.export"),
        functools.partial(model, weights=False),
    ),
    Case(
        "a model whose config.json is not JSON",
        "chat",
        ("{tmp}/model",),
        ("{tmp}/model: config.json is not valid JSON",),
        lambda tmp: (model(tmp), (tmp / "model" / "config.json").write_text("{,")),
    ),
    Case(
        "no room for a prompt",
        "chat",
        ("{tmp}/model", "--max-new-tokens", "200"),
        ("--max-new-tokens=200 leaves no room for a prompt within the model's 128 positions", "below 128"),
        functools.partial(model, config={"model_type": "opt", "hidden_size": 64, "max_position_embeddings": 128}),
    ),
]


def prepare(case: Case, tmp: Path) -> list[str]:
    run = make_run(tmp)
    if case.setup is not None:
        case.setup(tmp)
    return [a.replace("{tmp}", str(tmp)).replace("{run}", str(run)) for a in case.args]


def listing(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_use_gets_one_message(case: Case, tmp_path: Path, capsys, monkeypatch):
    """In this process (the entry points' main functions; the process boundary is the next test's)."""
    from ds_exp.exports.cli import chat_main, export_main

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    args = prepare(case, tmp_path)
    before = listing(tmp_path)
    try:
        code = (export_main if case.tool == "export" else chat_main)(args)
    except SystemExit as exited:  # a flag's own refusal (launch/flags.py FlagParser): one line, exit 2
        code = exited.code
    assert code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr and stderr.count("ds_exp: error") == 1, stderr
    assert "HYDRA_FULL_ERROR" not in stderr  # a usage error: nothing behind it to show
    for fragment in case.expect:
        fragment = fragment.replace("{tmp}", str(tmp_path)).replace("{run}", str(tmp_path / "run"))
        assert fragment in stderr, f"{fragment!r} not in:\n{stderr}"
    assert listing(tmp_path) == before  # nothing written, nothing removed


def test_help_and_refusals_never_import_torch(tmp_path: Path):
    """As users run them: a refusal is one message and exit 2 without a traceback, and neither it nor --help
    waits for torch, DeepSpeed or transformers to import."""
    run = make_run(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "ds_exp.export", str(run / "checkpoints" / "step3")],
        env=user_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("ds_exp: error: ") and "Traceback" not in proc.stderr
    code = (
        "import sys\n"
        "from ds_exp.exports.cli import chat_main, export_main\n"
        f"codes = [export_main([{str(run / 'checkpoints' / 'step3')!r}]), chat_main([{str(run)!r}])]\n"
        "print(codes, sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=user_env(), capture_output=True, text=True)
    assert proc.stdout.strip() == "[2, 2] []", proc.stdout + proc.stderr
    for tool in ("export", "chat"):
        shown = subprocess.run([sys.executable, "-m", f"ds_exp.{tool}", "--help"], env=user_env(), capture_output=True)
        assert shown.returncode == 0 and b"examples:" in shown.stdout


def test_the_examples_of_help_name_run_directories_as_runs_lay_them_out():
    """`--help`'s examples are paths a run writes: outputs/<experiment_name>/<date>_<time> as conf/config.yaml's
    hydra.run.dir lays it out (experiment_name default), not a layout of an older ds_exp."""
    import re

    from ds_exp.exports.cli import chat_parser, export_parser

    run_dir = str(OmegaConf.to_container(OmegaConf.load(conf_dir() / "config.yaml"))["hydra"]["run"]["dir"])
    pattern = re.escape(run_dir)
    pattern = pattern.replace(re.escape("${experiment_name}"), "default")
    pattern = pattern.replace(re.escape("${now:%Y-%m-%d_%H-%M-%S}"), r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d")
    for parser in (chat_parser(), export_parser()):
        shown = parser.format_help()
        paths = re.findall(r"outputs/\S+", shown.split("examples:")[1].split("\nA run directory")[0])
        assert len(paths) >= 3, shown
        for path in paths:
            assert re.match(pattern + r"(/|$)", path), f"{path} is not a run directory as {run_dir} makes it"
