"""What the console says, line by line, without a run (issue 35 §5-§8): `ds_exp: ...` lines, an error every rank
hits said once, plain progress lines for a pipe, the time apart, the training line, the command that continues a
stopped run, resume=auto without a run directory, and the listing of runs. The runs that print them:
tests/integration/test_console.py, test_training.py."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_exp.artifacts.summary import RunState, final_line, time_parts
from ds_exp.config.command_line import command, override
from ds_exp.launch.console import first_to_say
from ds_exp.launch.environment import LaunchInfo
from ds_exp.launch.help import RECIPES
from ds_exp.launch.run_dir import nothing_to_resume
from ds_exp.launch.run_logging import ConsoleFormatter
from ds_exp.resume.store import COMPLETE_MARKER
from ds_exp.sweeps import runs
from ds_exp.train.metrics import PlainProgress
from ds_exp.train.session import RELAUNCH, relaunch_command, training_line
from tests.training import REPO


def record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_console_lines_say_whose_they_are_and_nothing_else():
    console = ConsoleFormatter()
    assert console.format(record("ds_exp.train", logging.INFO, "eval at step 0")) == "ds_exp: eval at step 0"
    assert console.format(record("ds_exp", logging.WARNING, "x")) == "ds_exp: warning: x"
    foreign = record("torch.distributed", logging.ERROR, "gone")
    assert console.format(foreign) == "ds_exp: error: torch.distributed: gone"
    assert console.format(record("hydra", logging.INFO, "\t#0 : zero=stage0")) == "ds_exp: #0 : zero=stage0"
    assert console.format(record("ds_exp", logging.INFO, "ds_exp: said")) == "ds_exp: said"


def test_an_error_every_rank_hits_is_said_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # tempfile reads it once: its cache too
    monkeypatch.setattr("tempfile.tempdir", None)
    assert first_to_say("alone") and first_to_say("alone")  # one process: always
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    said = [first_to_say("ds_exp: error: train.max_evals=0: must be >= 1") for _ in range(3)]  # the ranks
    assert said == [True, False, False]
    assert first_to_say("ds_exp: error: rank 2's own")  # another message still prints
    assert len(list(tmp_path.glob("ds_exp-*/said/*"))) == 2


@pytest.mark.parametrize("planted", ["said is a link", "root is a link", "said is a file", "root is another's"])
def test_a_claim_folder_planted_by_someone_else_is_never_followed_nor_silences_an_error(planted, monkeypatch, tmp_path):
    """Issue 39 §1: with <tmp>/ds_exp-<uid>/said (or <tmp>/ds_exp-<uid>) a link to a user's project, a failing run
    deleted every file older than a day there; with `said` a plain file no rank printed the error at all."""
    tmp, project = tmp_path / "tmp", tmp_path / "project"
    tmp.mkdir()
    project.mkdir()
    old = project / "thesis.tex"
    old.write_text("years of work")
    os.utime(old, (1, 1))  # older than a day: what the claims' clean-up removes
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    root = tmp / f"ds_exp-{os.getuid()}"
    if planted == "root is a link":
        root.symlink_to(project)
    else:
        root.mkdir(mode=0o700)
        if planted == "said is a link":
            (root / "said").symlink_to(project)
        elif planted == "said is a file":
            (root / "said").write_text("")
        else:
            os.chmod(root, 0o777)  # what another user's directory is to this one: writable by others
    assert first_to_say("ds_exp: error: data.sources[0]: no such file") is True  # every rank says it
    assert old.read_text() == "years of work" and sorted(p.name for p in project.iterdir()) == ["thesis.tex"]


def test_the_claims_clean_up_removes_only_old_claims_it_made(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    folder = tmp_path / f"ds_exp-{os.getuid()}" / "said"
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(folder.parent, 0o700)
    mine, other = folder / f"12-34-{'a' * 16}", folder / "notes.txt"
    for path in (mine, other):
        path.write_text("")
        os.utime(path, (1, 1))
    assert first_to_say("ds_exp: error: x")
    assert not mine.exists() and other.exists()


def test_a_piped_run_says_its_progress_each_tenth_and_each_minute(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    progress = PlainProgress(total=250, initial=0, every_s=60)
    due = []
    for step in range(1, 251):
        clock[0] += 0.1 if step != 120 else 61  # a minute-long step 120 (an evaluation, a checkpoint)
        if progress.due(step):
            due.append(step)
            line = progress.line(step, {"loss": "2.4377", "lr": "9.05e-04", "tok_s": "975"})
    assert due == [25, 50, 75, 100, 120, 125, 150, 175, 200, 225, 250]
    assert line == "step 250/250 (100%): loss 2.4377, lr 9.05e-04, 975 tokens/s"
    resumed = PlainProgress(total=250, initial=100)
    assert not resumed.due(101) and resumed.due(125)


def test_the_final_line_says_compile_load_and_train_apart(tmp_path, monkeypatch):
    state = RunState(tmp_path / "run", "single", 1, started=time.time() - 212.3)
    state.compile_seconds, state.ready_seconds, state.train_seconds = 120.0, 131.5, 70.4
    state.status, state.steps = "completed", 250
    summary = state.as_summary([0])
    times = summary["time_s"]
    assert times["total"] == pytest.approx(212.3, abs=0.5) and times["load"] == pytest.approx(11.5)
    assert sum(times[k] for k in ("compile", "load", "train", "evaluate_and_save")) == pytest.approx(times["total"])
    monkeypatch.chdir(tmp_path)
    line = final_line(summary)
    assert re.match(
        r"ds_exp: completed 250 steps in 3m 3\ds \(compile 2m 00s, load 11.5 s, train 1m 10s, evaluate and save "
        r"\d+\.\d s\); eval perplexity n/a -> n/a; run directory run$",
        line,
    ), line
    # a resume: the steps this attempt trained, which its time is of, not the earlier attempt's too
    summary.update(steps=250, start_step=200)
    assert final_line(summary).startswith("ds_exp: completed 50 steps (201-250, resumed at step 200) in 3m ")
    warm = {"total": 21.0, "compile": 0.2, "load": 5.0, "train": 14.0, "evaluate_and_save": 1.8}
    assert time_parts(warm) == "21.0 s (load 5.0 s, train 14.0 s, evaluate and save 1.8 s)"


def test_the_training_line_says_what_the_user_asked_for(compose_cfg):
    cfg = compose_cfg("lora.dim=16", "lora.use_dora=true", "lora.use_rslora=true", "lora.alpha=32")
    ds_config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {}}}
    assert training_line(cfg.lora, ds_config, "bf16", dp=1, sp=2) == (
        "training: ZeRO stage 3, bf16, offload optimizer states to cpu, sequence parallel 2 (each sample over 2 "
        "ranks) x data parallel 1, LoRA rank 16, alpha 32 with DoRA and rsLoRA"
    )
    plain = {"zero_optimization": {"stage": 0}}
    assert training_line(compose_cfg().lora, plain, "fp32", dp=1, sp=1) == (
        "training: ZeRO stage 0, fp32, no offload, every parameter trained (lora.dim=0)"
    )


def test_a_stopped_run_names_the_command_that_continues_it(monkeypatch):
    monkeypatch.delenv(RELAUNCH, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    alone = LaunchInfo("single", 0, 0, 1, "127.0.0.1", 29500)
    assert relaunch_command(alone) == "python -m ds_exp"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    two = LaunchInfo("env", 0, 0, 2, "127.0.0.1", 29500, local_world_size=2)
    assert relaunch_command(two) == "torchrun --nproc_per_node 2 -m ds_exp"
    monkeypatch.setenv(RELAUNCH, "launchers/torchrun.sh 2")  # the launchers/ scripts say how they were typed
    assert relaunch_command(two) == "launchers/torchrun.sh 2"
    assert "python -m ds_exp hydra.run.dir=outputs/long resume=auto" in (REPO / "README.md").read_text()


def test_resume_auto_without_a_run_directory_names_the_runs_that_can_continue(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    experiment = tmp_path / "outputs" / "default"
    for name, step in (("2026-01-01_10-00-00", 4), ("2026-01-02_10-00-00", 8), ("2026-01-03_10-00-00", None)):
        (experiment / name).mkdir(parents=True)
        if step is not None:
            tag = experiment / name / "checkpoints" / f"step{step}"
            tag.mkdir(parents=True)
            (tag / "ds_exp_complete.json").write_text(json.dumps({"step": step}))
            (experiment / name / "summary.json").write_text(json.dumps({"status": "stopped", "steps": step}))
    said = nothing_to_resume(experiment / "2026-01-04_10-00-00", "checkpoints")
    assert said.startswith("resume=auto continues the run in hydra.run.dir, and none was given")
    assert "(outputs/default/2026-01-04_10-00-00), where there is nothing to resume" in said
    lines = said.splitlines()[1:3]
    assert lines == [
        "python -m ds_exp hydra.run.dir=outputs/default/2026-01-02_10-00-00 resume=auto   # step8, stopped",
        "python -m ds_exp hydra.run.dir=outputs/default/2026-01-01_10-00-00 resume=auto   # step4, stopped",
    ]


def test_report_lists_the_runs_of_a_tree_apart(tmp_path, capsys):
    """`python -m ds_exp.report outputs/`: each run (single runs and sweep jobs) with its status, steps, final eval
    and overrides; one killed before its summary says so, a dry run that it is one; nothing is written."""

    def run(path: str, overrides: list[str], summary: dict | None) -> None:
        (tmp_path / path / ".hydra").mkdir(parents=True)
        (tmp_path / path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        if summary is not None:
            (tmp_path / path / "summary.json").write_text(json.dumps(summary))

    final_eval = {"eval_loss": 1.359, "perplexity": 3.893}
    done = {"status": "completed", "steps": 250, "total_steps": 250, "final_eval": final_eval}
    run("default/2026-01-01_10-00-00", [], done)
    run("default/2026-01-01_11-00-00", ["lora.dim=8"], {"status": "stopped", "steps": 40, "total_steps": 250})
    run("default/2026-01-01_12-00-00", ["zero=stage3"], None)
    run("default/2026-01-01_13-00-00", ["dry_run=true"], None)
    (tmp_path / "default/2026-01-01_13-00-00/plan.json").write_text("{}")  # what a dry run leaves
    run("multirun/default/2026-01-02_10-00-00/0", ["zero=stage2"], done)
    # a value of another type (issue 39 §6) costs its run's line, never the listing
    run("multirun/default/2026-01-02_10-00-00/1", ["zero=stage3"], {**done, "final_eval": {"eval_loss": "1.2"}})
    before = sorted(tmp_path.rglob("*"))
    assert runs.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(tmp_path.rglob("*")) == before
    assert lines[0].split() == ["run", "status", "steps", "final", "eval", "overrides"]
    assert [line.split()[:3] for line in lines[1:]] == [
        ["default/2026-01-01_10-00-00", "completed", "250/250"],
        ["default/2026-01-01_11-00-00", "stopped", "40/250"],
        ["default/2026-01-01_12-00-00", "no", "summary"],
        ["default/2026-01-01_13-00-00", "dry", "run"],
        ["multirun/default/2026-01-02_10-00-00/0", "completed", "250/250"],
        [
            "multirun/default/2026-01-02_10-00-00/1",
            "damaged:",
            str(tmp_path / "multirun/default/2026-01-02_10-00-00/1/summary.json"),
        ],
    ]
    assert lines[6].split()[3:] == ["is", "damaged:", "final_eval.eval_loss", "is", "not", "a", "number", "zero=stage3"]
    assert lines[1].endswith("loss 1.3590, ppl 3.893  (defaults)") and lines[2].endswith("lora.dim=8")
    assert lines[5].endswith("zero=stage2")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert runs.main([str(empty)]) == 2
    assert "holds no ds_exp runs" in capsys.readouterr().err


def test_the_report_of_a_read_only_sweep_directory_is_printed(tmp_path, mount_tmpfs, capsys):
    """(issue 39 §6) Someone else's sweep, or one on a read-only disk: `python -m ds_exp.report DIR` prints its
    report and says in its heading that its files were not written; no traceback."""
    sweep = mount_tmpfs("1m")
    for number, summary in enumerate(({"status": "completed", "tokens_per_s": 9.0}, {"status": "failed"})):
        (sweep / str(number) / ".hydra").mkdir(parents=True)
        (sweep / str(number) / ".hydra" / "overrides.yaml").write_text(f"- train.max_steps={number + 2}\n")
        (sweep / str(number) / "summary.json").write_text(json.dumps(summary))
    subprocess.run(["mount", "-o", "remount,ro", str(sweep)], check=True)
    assert runs.main([str(sweep)]) == 1  # a job did not complete
    out = capsys.readouterr()
    heading = f"ds_exp sweep report (its files were not written into {sweep}: Read-only file system):"
    assert out.out.splitlines()[:4] == [
        heading,
        "job  status     train loss  tokens/s  peak MiB/rank  overrides that differ",
        "0    completed              9                        train.max_steps=2",
        "1    failed                                          train.max_steps=3",
    ]
    assert out.err == "" and sorted(p.name for p in sweep.iterdir()) == ["0", "1"]


def seconds(duration: str) -> float:
    """`21.3 s`, `2m 46s` (the console's durations) in seconds."""
    minutes = re.fullmatch(r"(\d+)m (\d+)s", duration)
    return int(minutes[1]) * 60 + int(minutes[2]) if minutes else float(duration.removesuffix(" s"))


def test_the_readme_and_help_give_the_default_runs_time_the_console_gives():
    """The same figure for `python -m ds_exp` in the README's words, its console block and --help."""
    readme = (REPO / "README.md").read_text()
    (said,) = re.findall(r"The default run takes about (\d+m \d+s|\d+ s) on 2 CPU cores", readme)
    (helped,) = re.findall(r"the tiny model on synthetic data, on this CPU \(about ([^)]+)\)", RECIPES)
    final = next(line for line in readme.splitlines() if line.startswith("ds_exp: completed 250 steps in "))
    total = re.match(r"ds_exp: completed 250 steps in (\d+m \d+s|\d+\.\d s) \(", final)
    assert total, final
    assert said == helped and abs(seconds(total[1]) - seconds(said)) <= 0.05 * seconds(said), (said, helped, final)


# issue 39 §5: every command ds_exp prints is pasted as it is; these are the directory names people make
HOSTILE_NAMES = [
    "my run", "a,b", "it's", 'say "hi"', "cost$HOME", "x=y", "[1,2]", "{a:1}", "back\\slash", "tab\there",
    "étude 2026", "${oc.env:HOME}", "~user", "-starts-with-dash", "semi;colon", "a&b", "paren(1)", "star*",
]  # fmt: skip


def pasted(printed: str) -> dict[str, str]:
    """What a shell, then Hydra, make of a printed command's overrides: key -> value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    words = shlex.split(printed)
    overrides = [w for w in words if "=" in w and not w.startswith("-")]
    parsed = OverridesParser.create().parse_overrides(overrides)
    return {o.key_or_group: o.value() for o in parsed}


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_printed_override_parses_back_to_its_value(name):
    assert pasted(command("python -m ds_exp", override("hydra.run.dir", f"outputs/{name}"), "resume=auto")) == {
        "hydra.run.dir": f"outputs/{name}",
        "resume": "auto",
    }


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=30))
@settings(max_examples=200, deadline=None)
def test_any_printable_value_survives_the_shell_and_hydra(value):
    assert pasted(command("python -m ds_exp", override("resume", value))) == {"resume": value}


def test_the_runs_resume_auto_can_continue_are_printed_to_paste(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    experiment = tmp_path / "outputs" / "default"
    run = experiment / "2026-01-03 my run,2"
    (run / "checkpoints" / "step4").mkdir(parents=True)
    (run / "checkpoints" / "step4" / COMPLETE_MARKER).write_text('{"step": 4}')
    said = nothing_to_resume(experiment / "2026-01-04_10-00-00", "checkpoints")
    line = next(line.strip() for line in said.splitlines() if line.strip().startswith("python -m ds_exp"))
    assert pasted(line.split("   #")[0]) == {"hydra.run.dir": "outputs/default/2026-01-03 my run,2", "resume": "auto"}
