"""Every command runs inside one error boundary (ds_exp/launch/console.py, issue 31 §1). The commands are found, not
listed: every ds_exp/*.py module with an `if __name__ == "__main__":` block (`python -m ds_exp.NAME`) and every
console script of pyproject.toml, so a command added later is checked as it lands.

For each command, in this process: a bad flag is argparse's usage and one error line (exit 2); a known problem is
its one message; anything unexpected is one line naming the file that keeps its traceback, with no secret in either;
HYDRA_FULL_ERROR=1 shows the traceback; Ctrl-C is exit 130; a closed standard output ends quietly (exit 141). One
process proves the last at the interpreter's exit, and `python -m ds_exp`'s Hydra task is checked where it reports
into the run directory: Hydra's job log before the run's own log exists, the rank's log once a training session
has it."""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import logging
import os
import re
import runpy
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

from ds_exp.config.secrets import REDACTED, register_secrets
from ds_exp.core.errors import ConfigError
from ds_exp.launch import lock
from ds_exp.launch.console import STDOUT_CLOSED, Command
from ds_exp.launch.run_logging import HELD, LOGGERS
from tests.training import REPO, user_env

SECRET = "sk-boundary-0123456789abcdef"  # registered as a credential: never shown, never written
UNEXPECTED = re.compile(r"^ds_exp: error: (.+) failed unexpectedly \((.+)\); its traceback is in (.+)$")


def _main_call(path: Path) -> str | None:
    """The function a module's `if __name__ == "__main__":` block calls (`sys.exit(main())` -> main)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
            return calls[0].func.id if calls else None  # type: ignore[union-attr]
    return None


def commands() -> list[tuple[str, str, str]]:
    """(how it is run, the module of its Command, the Command's name): `-m` for a `python -m` module, `script` for
    a console script."""
    found = []
    for path in sorted((REPO / "ds_exp").glob("*.py")):
        called = _main_call(path)
        if called is not None:
            found.append(("-m", "ds_exp" if path.stem == "__main__" else f"ds_exp.{path.stem}", called))
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for target in scripts.values():
        module, _, name = target.partition(":")
        found.append(("script", module, name))
    return found


COMMANDS = commands()


def command_of(how: str, module: str, name: str) -> Command:
    return getattr(importlib.import_module(f"{module}.__main__" if module == "ds_exp" else module), name)


def run(how: str, module: str, name: str, argv: list[str]) -> tuple[int, str, str]:
    """The command as `python -m MODULE ARGV` (or the console script) runs it, in this process."""
    out, err = io.StringIO(), io.StringIO()
    saved_argv, root = sys.argv, logging.getLogger()
    saved_handlers = root.handlers[:]
    code: int | str | None = 0
    try:
        sys.argv = [module, *argv]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before
            try:
                if how == "-m":
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    sys.exit(command_of(how, module, name)())
            except SystemExit as exited:
                code = exited.code
    finally:
        sys.argv = saved_argv
        root.handlers[:] = saved_handlers
        logging.captureWarnings(False)
        GlobalHydra.instance().clear()
        for held in list(lock._locks):  # a run that failed in this process: its directory's lock, as at its exit
            lock.release_run_dir(held)
    assert isinstance(code, int) or code is None, code
    return code or 0, out.getvalue(), err.getvalue()


def failing(exc: BaseException):
    def work(*args, **kwargs):
        raise exc

    return work


def test_every_command_is_found_and_runs_inside_the_boundary():
    found = {(how, module) for how, module, _ in COMMANDS}
    for module in ("ds_exp", "ds_exp.export", "ds_exp.chat", "ds_exp.universal", "ds_exp.parity", "ds_exp.report"):
        assert ("-m", module) in found
    assert ("script", "ds_exp.launch.cli") in found
    for how, module, name in COMMANDS:
        assert isinstance(command_of(how, module, name), Command), f"{module}.{name} is not an @entry_point"


@pytest.mark.parametrize(("how", "module", "name"), COMMANDS, ids=[f"{h} {m}" for h, m, _ in COMMANDS])
def test_each_way_a_command_ends_is_one_message(how, module, name, tmp_path, monkeypatch):
    command = command_of(how, module, name)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    register_secrets(environ={"BOUNDARY_TEST_API_KEY": SECRET})

    # a bad flag: one error line naming it and where the fix is (--help; Hydra's own parser prints its usage)
    code, out, err = run(how, module, name, ["x", "y", "--no-such-flag"])  # two: every positional given
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and "Traceback" not in err and out == "", err
    assert len(errors) == 1 and "--no-such-flag" in errors[0], err
    assert "usage:" in err or "--help" in errors[0], err

    # anything unexpected: one line naming the file that keeps the traceback; the secret in neither
    monkeypatch.setattr(command, "work", failing(RuntimeError(f"injected failure {SECRET}")))
    code, out, err = run(how, module, name, [])
    assert code == 1 and len(err.splitlines()) == 1 and out == "", err
    match = UNEXPECTED.match(err.strip())
    assert match and match.group(1) == command.name, err
    assert match.group(2) == f"RuntimeError: injected failure {REDACTED}"
    kept = Path(match.group(3))
    assert kept.parent == tmp_path / "cache" / "ds_exp" / "errors" and kept.name.startswith(command.name)
    text = kept.read_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError: injected failure" in text
    assert SECRET not in text + err

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the traceback on the console too
    code, out, err = run(how, module, name, [])
    assert code == 1 and "Traceback (most recent call last)" in err and UNEXPECTED.match(err.splitlines()[-1])
    assert SECRET not in out + err
    monkeypatch.delenv("HYDRA_FULL_ERROR")

    # a known problem: its message, its exit status
    monkeypatch.setattr(command, "work", failing(ConfigError("train.x=1: must be 2; give train.x=2")))
    code, _, err = run(how, module, name, [])
    assert (code, err) == (2, "ds_exp: error: train.x=1: must be 2; give train.x=2\n")

    # Ctrl-C: exit 130, one short line
    monkeypatch.setattr(command, "work", failing(KeyboardInterrupt()))
    code, _, err = run(how, module, name, [])
    assert (code, err) == (130, "ds_exp: interrupted\n")

    # standard output closed early (`| head`): quiet
    def chatty(*args, **kwargs):
        for _ in range(2000):
            print("x" * 99)

    read, write = os.pipe()
    os.close(read)  # its reader has gone, as `head` does after its first line
    with open(write, "w") as closed:
        monkeypatch.setattr(command, "work", chatty)
        monkeypatch.setattr(sys, "stdout", closed)
        try:
            code = command()
        except SystemExit as exited:  # `python -m ds_exp` ends the process with its status
            code = exited.code
        monkeypatch.undo()
    assert code == STDOUT_CLOSED


QUIET_PIPE = """
import json, os, runpy, sys, warnings
from ds_exp.exports.cli import chat_main

def run(module, *argv):
    read, write = os.pipe()
    os.close(read)  # the reader has gone before anything is written: every write fails
    os.dup2(write, 1)
    os.close(write)
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as exited:
        return exited.code

def chatty(argv=None):
    for _ in range(2000):
        print("an answer " * 10)

warnings.simplefilter("ignore", RuntimeWarning)
sweep_dir = sys.argv[1]
codes = {"help": run("ds_exp", "--help"), "report": run("ds_exp.report", sweep_dir)}
chat_main.work = chatty  # a model's answers, without the model
codes["chat"] = run("ds_exp.chat", "model_dir")
print(json.dumps(codes), file=sys.stderr)
"""


def test_a_closed_standard_output_ends_quietly_at_exit(tmp_path):
    """`python -m ds_exp --help | head -1`, `python -m ds_exp.report DIR | head -1`, chat's answers piped to head:
    no BrokenPipeError, no "Exception ignored" when the interpreter flushes its streams at exit."""
    job = tmp_path / "sweep" / "0" / ".hydra"
    job.mkdir(parents=True)
    (job / "overrides.yaml").write_text("- train.seed=0\n")
    (job / "config.yaml").write_text("{}\n")
    proc = subprocess.run(
        [sys.executable, "-c", QUIET_PIPE, str(tmp_path / "sweep")],
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    codes = json.loads(proc.stderr.strip().splitlines()[-1])
    assert codes["help"] in (0, STDOUT_CLOSED) and codes["report"] == codes["chat"] == STDOUT_CLOSED, codes
    for noise in ("Traceback", "BrokenPipeError", "Exception ignored", "Broken pipe"):
        assert noise not in proc.stderr, proc.stderr


# ------------------------------------------------------------------------ python -m ds_exp's Hydra task


@pytest.fixture
def logging_restored():
    """A run in this process sets up its rank's logging (loggers' handlers, levels, propagation): undone after."""
    names = [None, *LOGGERS, "transformers", "datasets"]
    saved = {n: (lg.handlers[:], lg.filters[:], lg.level, lg.propagate) for n in names if (lg := logging.getLogger(n))}
    yield
    for name, (handlers, filters, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:], logger.filters[:], logger.level, logger.propagate = handlers, filters, level, propagate
    HELD.records.clear()
    HELD.active = True


def run_ds_exp(tmp_path: Path) -> tuple[int, str, str]:
    register_secrets(environ={"BOUNDARY_TEST_API_KEY": SECRET})
    return run("-m", "ds_exp", "main", [f"hydra.run.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache"])


def test_an_unexpected_error_before_the_run_starts_is_kept_in_hydras_job_log(tmp_path, monkeypatch):
    from ds_exp.launch import cli

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(cli, "check_hub", failing(RuntimeError(f"injected failure {SECRET}")))
    code, out, err = run_ds_exp(tmp_path)
    assert code == 1 and "Error executing job" not in out + err and "Traceback" not in out + err, err
    assert err.count("ds_exp: error") == 1 and (match := UNEXPECTED.match(err.strip().splitlines()[-1])), err
    assert match.groups() == ("the run", f"RuntimeError: injected failure {REDACTED}", str(tmp_path / "run/ds_exp.log"))
    text = (tmp_path / "run" / "ds_exp.log").read_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError: injected failure" in text
    assert SECRET not in text + out + err


def test_hydras_own_error_is_one_line_under_a_debugger_too(tmp_path, monkeypatch):
    """Hydra's own errors (a bad override) reach the boundary, also when a trace function is set (a debugger, a
    coverage tool, where Hydra re-raises them itself): one line in ds_exp's format, exit 2, not an unexpected
    error."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    previous = sys.gettrace()
    sys.settrace(lambda *args: None)
    try:
        code, out, err = run("-m", "ds_exp", "main", ["train.micro_batch_size=abc", f"hydra.run.dir={tmp_path}/run"])
    finally:
        sys.settrace(previous)
    assert (code, err) == (
        2,
        "ds_exp: error: train.micro_batch_size=abc: Value 'abc' of type 'str' could not be converted to Integer\n",
    ), err
    assert "Traceback" not in out + err and not (tmp_path / "cache").exists()


def test_an_unexpected_error_in_a_training_session_is_kept_in_the_ranks_log(tmp_path, monkeypatch, logging_restored):
    """The session writes summary.json (status failed) and its rank's log keeps the traceback; the console has one
    line naming that log, and neither the session's traceback nor Hydra's "Error executing job"."""
    from ds_exp.runtime.rank_logging import setup_run_logging
    from ds_exp.train import recipe
    from ds_exp.train.session import Session

    def start_without_a_process_group(self: Session) -> None:  # the rest of the session is the real one
        self.state.log_file = str(setup_run_logging(self.run_dir, self.rank))

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(Session, "start", start_without_a_process_group)
    monkeypatch.setattr(recipe, "setup", failing(RuntimeError(f"injected failure {SECRET}")))
    code, out, err = run_ds_exp(tmp_path)
    assert code == 1 and "Error executing job" not in out + err and "Traceback" not in out + err, err
    assert err.count("ds_exp: error") == 1 and (match := UNEXPECTED.match(err.strip().splitlines()[-1])), err
    assert match.group(3) == str(tmp_path / "run" / "logs" / "rank0.log")
    text = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert text.count("Traceback (most recent call last)") == 1 and "RuntimeError: injected failure" in text
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("failed", f"RuntimeError: injected failure {REDACTED}")
    assert SECRET not in text + out + err
